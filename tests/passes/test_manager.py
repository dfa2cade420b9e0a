import pytest
from pass_helpers import decoder_graph

from atomc.passes import PassManager
from atomc.passes.base import AtomcPass, PassResult
from atomc.passes.noop_elimination import NoopElimination

ORDER = [
    "noop_elimination", "canonicalize", "fuse_add_rmsnorm", "fuse_silu_mul", "share_fp8_quant",
    "fuse_rmsnorm_fp8_quant", "fuse_silu_mul_fp8_quant", "fuse_fp8_quant_linear", "fuse_rope_kv_write",
    "fuse_qk_norm_rope",
    "fuse_mla_latent_norm_rope", "decode_gemv", "lowering",
]  # fmt: skip


def test_default_order_and_disabling():
    assert PassManager.for_platform("cpu").names == ORDER
    pm = PassManager.for_platform("cuda", disabled=["fuse_rope_kv_write"])
    assert "fuse_rope_kv_write" not in pm.names and len(pm.names) == len(ORDER) - 1
    with pytest.raises(ValueError, match="fuse_silu_mul") as err:
        PassManager.for_platform("cpu", disabled=["fuse_silu"])
    assert "fuse_silu" in str(err.value)  # names the unknown one and lists the valid ones
    with pytest.raises(ValueError, match="platform"):
        PassManager.for_platform("metal")


def test_uuids_are_stable_and_follow_source_and_platform(tmp_path, monkeypatch):
    a, b = PassManager.for_platform("cpu").uuids(), PassManager.for_platform("cpu").uuids()
    assert a == b and [n for n, _ in a] == ORDER and all(len(u) == 64 for _, u in a)
    assert dict(a)["lowering"] != dict(PassManager.for_platform("cuda").uuids())["lowering"]

    # editing a file the pass is made of changes its id
    src = tmp_path / "noop_elimination.py"
    src.write_text("x = 1\n")
    monkeypatch.setattr(NoopElimination, "source_files", lambda self: [src])
    before = NoopElimination().uuid()
    src.write_text("x = 2\n")
    assert NoopElimination().uuid() != before


def test_source_files_name_what_each_pass_is_made_of():
    pm = PassManager.for_platform("cpu")
    files = {p.name: {f.name for f in p.source_files()} for p in pm.passes}
    assert files["fuse_silu_mul"] == {"fuse_silu_mul.py"}
    # the FP8 passes name the matchers they share
    assert files["fuse_silu_mul_fp8_quant"] == {"fuse_silu_mul_fp8_quant.py", "fp8_match.py"}
    assert files["fuse_rmsnorm_fp8_quant"] == {"fuse_rmsnorm_fp8_quant.py", "fp8_match.py"}
    assert files["share_fp8_quant"] == {"share_fp8_quant.py", "fp8_match.py"}
    assert files["fuse_fp8_quant_linear"] == {"fuse_fp8_quant_linear.py", "fp8_match.py"}
    assert {"canonicalize.py", "rope.py", "rms_norm.py", "__init__.py"} <= files["canonicalize"]
    assert {"lowering.py", "registry.py"} <= files["lowering"]
    assert set(pm.source_files()) == {f for p in pm.passes for f in p.source_files()}


def test_run_reports_each_pass():
    gm, _ = decoder_graph()
    reports = PassManager.for_platform("cpu").run(gm)
    assert [r.name for r in reports] == ORDER
    by = {r.name: r for r in reports}
    assert by["fuse_add_rmsnorm"].rewritten == 2 and by["fuse_silu_mul"].rewritten == 1
    assert "atomc.paged_attention" in by["fuse_rope_kv_write"].graph_after
    assert all(r.seconds >= 0 and r.uuid for r in reports)


def test_custom_pass_list():
    class Count(AtomcPass):
        name = "count"

        def __call__(self, gm):
            n = len(gm.graph.nodes)
            return PassResult(n, 0, "nodes")

    gm, _ = decoder_graph()
    (report,) = PassManager([Count()]).run(gm)
    assert report.matched == len(gm.graph.nodes) and report.notes == "nodes"
    with pytest.raises(ValueError, match="duplicate"):
        PassManager([Count(), Count()])
