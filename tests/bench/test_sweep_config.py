"""The CVS ATOM config rules of `atomc bench sweep`: profiles, placeholders, threshold files, params,
drivers, multi-node fields and the gated-metric coverage rule, each with the message a user sees."""

import json
import math

import pytest

from atomc import env
from atomc.bench import config as cfgmod
from atomc.bench import sweep as sw
from atomc.bench.config import (
    SweepConfigError,
    client_timeout_s,
    load_sweep_config,
    load_thresholds,
    resolve_threshold_path,
    server_ready_timeout_s,
)
from atomc.bench.suite import check_thresholds
from atomc.bench.thresholds import GATED_METRICS, Status, gate_block, gate_cells

# the reference page's own threshold examples
PAGE_SINGLE_NODE_CELL = {
    "ISL=1024,OSL=1024,TP=8,PP=1,CONC=128": {
        "output_throughput": {"kind": "min_tok_s", "value": 1500},
        "p99_ttft_ms": {"kind": "max_ms", "value": 5000},
        "success_rate": {"kind": "min", "value": 1},
        "failed": {"kind": "max", "value": 0},
    }
}
PAGE_MULTINODE_CELL = {
    "ISL=1024,OSL=1024,TP=8,PP=2,CONC=128": {
        "output_throughput": {"kind": "min_tok_s", "value": 2500},
        "scaling.efficiency_pct": {"kind": "min", "value": 80},
    }
}
SWEEP_1K = {
    "sequence_combinations": [{"name": "w1_1k_1k", "isl": "1024", "osl": "1024"}],
    "runs": [{"combo": "w1_1k_1k", "concurrency": 128}],
}


def single_node(**params) -> dict:
    return {
        "schema_version": 1,
        "framework": "atom",
        "enforce_thresholds": True,
        "threshold_json": "mi325x_atom_x_threshold.json",
        "model": {"id": "some/model"},
        "roles": {"server": {"atom_args": ["-tp", "8"]}},
        "params": {"driver": "atom", "tensor_parallelism": "8", "num_prompts": "1000", **params},
        "sweep": SWEEP_1K,
    }


def multinode(**params) -> dict:
    return {
        "schema_version": 1,
        "framework": "atom",
        "enforce_thresholds": True,
        "threshold_json": "mi325x_atom_x_distributed_threshold.json",
        "model": {"id": "some/model"},
        "roles": {"server": {"serve_args": {"pipeline-parallel-size": 2}, "ib_netdev": "auto"}},
        "params": {
            "driver": "vllm_atom", "tensor_parallelism": "8", "pipeline_parallel_size": "2", "nnodes": "2",
            "master_addr": "10.0.0.1", "master_port": "29501", "num_prompts": "1000",
            "scaling_baseline_output_throughput": "1600", **params,
        },
        "sweep": SWEEP_1K,
    }  # fmt: skip


def profiles_file() -> dict:
    """A schema_version 2 file shaped like the page's DeepSeek-R1 one: `perf` and `mtp3` profiles."""
    return {
        "_comment": "ignored",
        "schema_version": 2,
        "framework": "atom",
        "gpu_arch": "mi325x",
        "default_profile": "perf",
        "threshold_json": "mi325x_atom_deepseek-r1_fp8_threshold.json",
        "paths": {"shared_fs": "/home/{user-id}", "models_dir": "/home/models", "log_dir": "{shared_fs}/LOGS"},
        "model": {"id": "{paths.models_dir}/DeepSeek-R1-0528", "precision": "fp8"},
        "profiles": {
            "perf": {
                "enforce_thresholds": True,
                "run_card": {"notes": "lab reference"},
                "roles": {"server": {"atom_args": ["-tp", "8", "--kv_cache_dtype", "fp8"]}},
                "params": {"driver": "atom", "port_no": "8000", "tensor_parallelism": "8",
                           "random_range_ratio": "0.8", "num_prompts": "1000", "max_model_length": "4096",
                           "metric_percentiles": "95,99", "reuse_server_across_sweep": "true",
                           "client_poll_count": "80", "client_poll_wait_time": "60"},
                "platform": {"gpu_metrics_poll": True},
                "sweep": {"sequence_combinations": [{"name": "w1_1k_1k", "isl": "1024", "osl": "1024"}],
                          "runs": [{"combo": "w1_1k_1k", "concurrency": 128},
                                   {"combo": "w1_1k_1k", "concurrency": 256}]},
            },
            "mtp3": {
                "enforce_thresholds": False,
                "_note": "speculative decoding",
                "roles": {"server": {"atom_args": ["-tp", "8", "--method", "mtp", "--num-speculative-tokens", "3"]}},
                "params": {"driver": "atom", "tensor_parallelism": "8", "num_prompts": "1000",
                           "max_model_length": "4096"},
                "mtp_quality": {"enabled": True, "chat_template_prompt": "Briefly introduce yourself.",
                                "chat_template_expected_sha256": ""},
                "functional": {"api_smoke": True, "health_check": True},
                "sweep": {"sequence_combinations": [{"name": "w1_1k_1k", "isl": "1024", "osl": "1024"}],
                          "runs": [{"combo": "w1_1k_1k", "concurrency": 128}]},
            },
        },
    }  # fmt: skip


def write(tmp_path, data: dict, name: str = "mi325x_atom_x_single.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


# --- the page's examples ------------------------------------------------------------------------


def test_page_single_node_cell_loads_and_gates(tmp_path):
    path = write(tmp_path, single_node())
    (tmp_path / "mi325x_atom_x_threshold.json").write_text(json.dumps(PAGE_SINGLE_NODE_CELL))
    cfg = load_sweep_config(path)
    assert [c.key for c in cfg.cells] == ["ISL=1024,OSL=1024,TP=8,PP=1,CONC=128"]
    assert cfg.gpu_arch == "mi325x" and cfg.profile == "perf" and cfg.native
    thresholds = load_thresholds(resolve_threshold_path(cfg, None), cfg.profile)
    metrics = {"output_throughput": 1600.0, "p99_ttft_ms": 4000.0, "success_rate": 1.0, "failed": 0}
    rows = gate_cells({cfg.cells[0].key: metrics}, thresholds)
    assert [r.status for r in rows] == [Status.PASS] * 4
    # the page's cell gates 4 metrics: record-only it runs (gaps noted), enforced it is incomplete
    notes = check_thresholds(cfg, thresholds, enforce=False)
    assert len(notes) == 1 and "no spec for gated metrics" in notes[0] and "mean_ttft_ms" in notes[0]
    with pytest.raises(SweepConfigError, match=r"does not cover the run:\n  - cell ISL=1024.*total_token_throughput"):
        check_thresholds(cfg, thresholds, enforce=True)


def test_page_multinode_cell_loads_and_gates_scaling(tmp_path):
    path = write(tmp_path, multinode(), "mi325x_atom_x_distributed.json")
    (tmp_path / "mi325x_atom_x_distributed_threshold.json").write_text(json.dumps(PAGE_MULTINODE_CELL))
    cfg = load_sweep_config(path)
    assert [c.key for c in cfg.cells] == ["ISL=1024,OSL=1024,TP=8,PP=2,CONC=128"]  # nnodes is not in the key
    assert cfg.params["nnodes"] == 2 and cfg.params["master_addr"] == "10.0.0.1" and not cfg.native
    assert any("serve_args is not used" in n for n in cfg.notes)
    # scaling.efficiency_pct = output tok/s / (nnodes x single-node baseline), in percent
    measured = {"output_throughput": 2720.0, "total_token_throughput": 5440.0}
    derived = sw.derived_metrics(measured, cfg.cells[0], cfg.params)
    assert derived["scaling.efficiency_pct"] == pytest.approx(85.0)
    assert derived["per_gpu_throughput"] == pytest.approx(5440.0 / 16)  # TP 8 x PP 2 GPUs
    thresholds = load_thresholds(resolve_threshold_path(cfg, None), cfg.profile)
    rows = gate_cells({cfg.cells[0].key: {"output_throughput": 2720.0, **derived}}, thresholds)
    statuses = {r.metric: r.status for r in rows}
    assert statuses == {"output_throughput": Status.PASS, "scaling.efficiency_pct": Status.PASS}
    assert check_thresholds(cfg, thresholds, enforce=False)  # the gated metrics are noted as missing


def test_page_profiles_file_loads_each_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "user_name", lambda: "alice")
    monkeypatch.delenv("CVS_CONFIG_PROFILE", raising=False)
    path = write(tmp_path, profiles_file(), "mi325x_atom_deepseek-r1_fp8_single.json")
    perf = load_sweep_config(path)
    assert perf.profile == "perf" and perf.schema_version == 2 and perf.enforce_thresholds
    assert [c.concurrency for c in perf.cells] == [128, 256]
    assert perf.model_id == "/home/models/DeepSeek-R1-0528"  # {paths.models_dir}
    assert perf.params["reuse_server_across_sweep"] is True and perf.params["metric_percentiles"] == "95,99"
    assert perf.blocks == {"platform": {"gpu_metrics_poll": True}} and perf.run_card == {"notes": "lab reference"}
    mtp = load_sweep_config(path, "mtp3")
    assert mtp.profile == "mtp3" and not mtp.enforce_thresholds
    assert "--num-speculative-tokens" in mtp.server_args
    assert set(mtp.blocks) == {"functional", "mtp_quality"}
    monkeypatch.setenv("CVS_CONFIG_PROFILE", "mtp3")  # the env var picks the profile too
    assert load_sweep_config(path).profile == "mtp3"
    assert load_sweep_config(path, "perf").profile == "perf"  # the flag wins over the env var


# --- profiles and placeholders -------------------------------------------------------------------


def test_profile_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("CVS_CONFIG_PROFILE", raising=False)
    path = write(tmp_path, profiles_file())
    with pytest.raises(SweepConfigError, match=r"no profile 'nope'; profiles: mtp3, perf"):
        load_sweep_config(path, "nope")
    flat = write(tmp_path, single_node(), "flat.json")
    assert load_sweep_config(flat, "perf").profile == "perf"  # the implicit profile
    with pytest.raises(SweepConfigError, match="only the implicit profile 'perf'; profile 'mtp3'"):
        load_sweep_config(flat, "mtp3")
    with pytest.raises(SweepConfigError, match="'profiles' needs schema_version 2"):
        load_sweep_config(write(tmp_path, {**single_node(), "profiles": {}}, "bad.json"))
    with pytest.raises(SweepConfigError, match="schema_version must be 1 .* or 2"):
        load_sweep_config(write(tmp_path, {**single_node(), "schema_version": 3}, "bad.json"))
    with pytest.raises(SweepConfigError, match="unknown top-level fields \\['sweeep'\\]"):
        load_sweep_config(write(tmp_path, {**single_node(), "sweeep": {}}, "bad.json"))


def test_default_profile_then_perf(tmp_path, monkeypatch):
    monkeypatch.delenv("CVS_CONFIG_PROFILE", raising=False)
    data = profiles_file()
    data["default_profile"] = "mtp3"
    assert load_sweep_config(write(tmp_path, data)).profile == "mtp3"
    del data["default_profile"]
    assert load_sweep_config(write(tmp_path, data)).profile == "perf"


def test_placeholders(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "user_name", lambda: "bob")
    data = single_node()
    data["paths"] = {"shared_fs": "/home/{user-id}", "log_dir": "{shared_fs}/LOGS", "models_dir": "/models"}
    data["model"] = {"id": "{paths.models_dir}/m"}
    data["roles"]["server"]["atom_args"] = "--cache-dir {paths.log_dir}/cache"
    data["threshold_json"] = "{user-id}_threshold.json"  # a literal file name: never substituted
    cfg = load_sweep_config(write(tmp_path, data))
    assert cfg.model_id == "/models/m"
    assert cfg.server_args == ["-tp", "8"][:0] + ["--cache-dir", "/home/bob/LOGS/cache"]
    assert cfg.threshold_json == "{user-id}_threshold.json"
    data["model"] = {"id": "{paths.nowhere}/m"}
    with pytest.raises(SweepConfigError, match=r"placeholder \{paths.nowhere\} names no key of 'paths'"):
        load_sweep_config(write(tmp_path, data))


def test_private_keys_ignored_everywhere(tmp_path):
    data = single_node(_note="x")
    data["_comment"] = "top"
    data["sweep"] = {**SWEEP_1K, "_why": 1}
    data["roles"]["server"]["_c"] = 1
    cfg = load_sweep_config(write(tmp_path, data))
    assert "_note" not in cfg.params and len(cfg.cells) == 1


# --- threshold files -----------------------------------------------------------------------------


def test_threshold_resolution_and_ambiguity(tmp_path):
    data = single_node()
    del data["threshold_json"]
    path = write(tmp_path, data)
    cfg = load_sweep_config(path)
    assert resolve_threshold_path(cfg, None) is None  # none there: nothing gated
    (tmp_path / "a_threshold.json").write_text("{}")
    assert resolve_threshold_path(cfg, None) == tmp_path / "a_threshold.json"  # the only one
    cfg.threshold_json = "a_threshold.json"  # named next to the config
    assert resolve_threshold_path(cfg, None) == tmp_path / "a_threshold.json"
    cfg.threshold_json = "missing_threshold.json"
    with pytest.raises(SweepConfigError, match="threshold file not found"):
        resolve_threshold_path(cfg, None)
    (tmp_path / "b_threshold.json").write_text("{}")
    for named in (None, "a_threshold.json"):  # the page: several in one folder is ambiguous, named or not
        cfg.threshold_json = named
        with pytest.raises(SweepConfigError, match="ambiguous threshold files in .*a_threshold.json, b_threshold.json"):
            resolve_threshold_path(cfg, None)
    assert resolve_threshold_path(cfg, tmp_path / "b_threshold.json") == tmp_path / "b_threshold.json"


def test_threshold_file_with_profiles(tmp_path):
    path = tmp_path / "t_threshold.json"
    path.write_text(json.dumps({"_c": 1, "profiles": {"perf": PAGE_SINGLE_NODE_CELL, "mtp3": {}}}))
    assert load_thresholds(path, "perf") == PAGE_SINGLE_NODE_CELL
    with pytest.raises(SweepConfigError, match="no thresholds for profile 'x' \\(profiles: mtp3, perf\\)"):
        load_thresholds(path, "x")
    path.write_text("[1]")
    with pytest.raises(SweepConfigError, match="JSON object keyed by cell"):
        load_thresholds(path, "perf")


def test_missing_metric_is_skipped_at_gate_time():
    full = {m: {"kind": "info"} for m in GATED_METRICS} | {"p99_ttft_ms": {"kind": "max_ms", "value": 10}}
    rows = {r.metric: r for r in gate_cells({"K": {"failed": 0}}, {"K": full})}
    assert rows["p99_ttft_ms"].status is Status.SKIP and rows["p99_ttft_ms"].reason == "metric missing from results"


def test_scaling_spec_required_on_multinode_runs(tmp_path):
    cfg = load_sweep_config(write(tmp_path, multinode(), "mn.json"))
    complete = {cfg.cells[0].key: {m: {"kind": "info"} for m in GATED_METRICS}}
    with pytest.raises(SweepConfigError, match="needs scaling.efficiency_pct in every cell"):
        check_thresholds(cfg, complete, enforce=True)
    complete[cfg.cells[0].key]["scaling.efficiency_pct"] = {"kind": "min", "value": 80}
    assert check_thresholds(cfg, complete, enforce=True) == []


def test_block_thresholds_flat_and_grouped():
    specs = {
        "_c": "x",
        "mtp.acceptance_rate": {"kind": "min", "value": 0.6},
        "gsm8k_flex": {"gsm8k.exact_match__flexible-extract": {"kind": "min", "value": 0.94}},
        "gsm8k_strict": {},
    }
    metrics = {"mtp.acceptance_rate": 0.7, "gsm8k_flex/gsm8k.exact_match__flexible-extract": 0.9}
    rows = {r.metric: r for r in gate_block("accuracy", metrics, specs)}
    assert rows["mtp.acceptance_rate"].status is Status.PASS and rows["mtp.acceptance_rate"].cell == "accuracy"
    assert rows["gsm8k_flex/gsm8k.exact_match__flexible-extract"].status is Status.FAIL
    assert set(rows) == {"mtp.acceptance_rate", "gsm8k_flex/gsm8k.exact_match__flexible-extract"}
    assert gate_block("accuracy", {}, specs)[0].status is Status.SKIP  # not produced: skipped, reported


# --- params --------------------------------------------------------------------------------------


def test_params_parsed_with_their_defaults(tmp_path):
    cfg = load_sweep_config(write(tmp_path, single_node(request_rate="inf", seed="3", max_model_length="4096")))
    p = cfg.params
    assert p["request_rate"] == math.inf and p["seed"] == 3 and p["tensor_parallelism"] == 8
    assert p["driver"] == "atom" and p["nnodes"] == 1 and p["pipeline_parallel_size"] == 1
    # CVS's waits: server ready = precheck + warm-up + polls; client = initial + polls
    assert server_ready_timeout_s(p) == 30 + 330 + 60 * 60
    assert client_timeout_s(p) == 120 + 50 * 60
    p2 = load_sweep_config(write(tmp_path, single_node(
        server_precheck_wait_s="1", server_warmup_wait_s="2", server_poll_count="3", server_poll_wait_time="4",
        client_initial_wait_s="5", client_poll_count="6", client_poll_wait_time="7",
    ))).params  # fmt: skip
    assert server_ready_timeout_s(p2) == 1 + 2 + 3 * 4 and client_timeout_s(p2) == 5 + 6 * 7
    p3 = load_sweep_config(write(tmp_path, single_node(server_ready_timeout_s="9"))).params
    assert server_ready_timeout_s(p3) == 9  # atomc's own field replaces the sum


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("dataset_name", "sharegpt", "params.dataset_name='sharegpt' is not supported: atomc bench only draws random"),
        ("burstiness", "2.0", "params.burstiness='2.0' is not supported: arrivals are Poisson"),
        ("random_prefix_len", "64", "params.random_prefix_len='64' is not supported"),
        ("tokenizer_mode", "slow", "params.tokenizer_mode='slow' is not supported: prompts are token ids"),
        ("bench_extra_args", "--use-chat-template", "params.bench_extra_args='--use-chat-template' is not supported"),
        ("backend", "tgi", "params.backend='tgi' is not supported"),
        ("driver", "trtllm", "params.driver='trtllm' is not supported"),
        ("percentile_metrics", "ttft,goodput", "params.percentile_metrics: unknown metric families \\['goodput'\\]"),
        ("metric_percentiles", "95,100", "params.metric_percentiles: percentiles lie in \\(0, 100\\)"),
        ("num_prompts", "many", "params.num_prompts must be an integer, got 'many'"),
        ("request_rate", "0", "params.request_rate must be > 0"),
        ("reuse_server_across_sweep", "maybe", "params.reuse_server_across_sweep must be true or false"),
        ("result_filename", "../x", "params.result_filename must be a plain file name"),
        ("num_promts", "8", "unknown params \\['num_promts'\\]; known: "),
    ],
)
def test_params_refused_with_a_message_naming_them(tmp_path, field, value, message):
    with pytest.raises(SweepConfigError, match=message):
        load_sweep_config(write(tmp_path, single_node(**{field: value})))


def test_every_page_params_field_is_handled():
    """The page's params table, and each field of the CVS ATOM params model, is in PARAMS (honoured or refused)."""
    page = {
        "driver", "tensor_parallelism", "pipeline_parallel_size", "nnodes", "master_addr", "master_port",
        "num_prompts", "max_model_length", "random_range_ratio", "metric_percentiles", "reuse_server_across_sweep",
        "scaling_baseline_output_throughput", "server_precheck_wait_s", "server_warmup_wait_s", "server_poll_count",
        "server_poll_wait_time", "client_poll_count", "client_poll_wait_time", "client_initial_wait_s",
        "backend", "base_url", "port_no", "dataset_name", "burstiness", "seed", "request_rate", "random_prefix_len",
        "tokenizer_mode", "percentile_metrics", "bench_max_failed_requests", "bench_extra_args", "result_filename",
    }  # fmt: skip
    assert page <= set(cfgmod.PARAMS)


def test_max_model_length_checks_cells_and_reaches_the_server(tmp_path):
    long = load_sweep_config(write(tmp_path, single_node(max_model_length="3000", random_range_ratio="0.8")))
    assert any("longest request (3688 tokens" in n and "max_model_length 3000" in n for n in long.notes)
    cfg = load_sweep_config(write(tmp_path, single_node(max_model_length="4096")))
    assert sw.native_server_args(cfg)[-2:] == ["--max-model-len", "4096"]
    cfg.server_args = ["--max-model-len=2048"]  # the server flag given by hand wins
    assert sw.native_server_args(cfg) == ["--max-model-len=2048", "--tensor-parallel-size", "8"]


def test_reuse_server_across_sweep_sessions(tmp_path):
    data = single_node()
    data["sweep"] = {
        "sequence_combinations": [{"name": "a", "isl": 8, "osl": 4}, {"name": "b", "isl": 16, "osl": 4}],
        "runs": [{"combo": "a", "concurrency": 1}, {"combo": "a", "concurrency": 2}, {"combo": "b", "concurrency": 1}],
    }

    def sessions(reuse):
        extra = {} if reuse is None else {"reuse_server_across_sweep": reuse}
        data["params"] = {**single_node()["params"], **extra}
        cfg = load_sweep_config(write(tmp_path, data))
        return len({sw.session_key(cfg, c) for c in cfg.cells})

    assert sessions(None) == 1  # atomc's default: one server for the whole sweep
    assert sessions("true") == 2  # CVS: a server per shape
    assert sessions("false") == 3  # CVS: a fresh server per cell


# --- drivers, --base-url, multi-node --------------------------------------------------------------


def test_external_drivers_need_a_server_the_user_started(tmp_path):
    cfg = load_sweep_config(write(tmp_path, single_node(driver="sglang", tensor_parallelism="1")))
    with pytest.raises(SweepConfigError, match="atomc does not start sglang servers. Start the server yourself"):
        sw.external_base_url(cfg, None)
    assert sw.external_base_url(cfg, "http://h:30000/") == "http://h:30000"
    cfg.params.update(base_url="http://10.1.1.1", port_no=30000)
    assert sw.external_base_url(cfg, None) == "http://10.1.1.1:30000"
    native = load_sweep_config(write(tmp_path, single_node(tensor_parallelism="1")))
    assert sw.external_base_url(native, None) is None  # atomc serve is started
    assert sw.external_base_url(native, "http://x:1") == "http://x:1"


def test_launch_refusals(tmp_path):
    cfg = load_sweep_config(write(tmp_path, single_node()))
    sw.check_can_launch(cfg)  # TP 8 on one machine is atomc serve --tensor-parallel-size 8
    assert sw.native_server_args(cfg).count("-tp") == 1  # the page's atom_args give it: not twice
    cfg.server_args = []
    assert sw.native_server_args(cfg)[-2:] == ["--tensor-parallel-size", "8"]
    mn = single_node(tensor_parallelism="1", nnodes="2", master_addr="10.0.0.1")
    with pytest.raises(SweepConfigError, match="atomc cannot launch a multi-node server yet"):
        sw.check_can_launch(load_sweep_config(write(tmp_path, mn)))
    with pytest.raises(SweepConfigError, match="params.nnodes=2 needs params.master_addr"):
        load_sweep_config(write(tmp_path, single_node(nnodes="2")))
    with pytest.raises(SweepConfigError, match="pipeline_parallel_size=2 > 1 needs params.nnodes > 1"):
        load_sweep_config(write(tmp_path, single_node(driver="vllm_atom", pipeline_parallel_size="2")))
    pp_page = single_node(tensor_parallelism="1", pipeline_parallel_size="2")
    pp_page["roles"]["server"]["atom_args"] = []
    pp_one_node = load_sweep_config(write(tmp_path, pp_page))
    sw.check_can_launch(pp_one_node)  # one machine: atomc serve runs the stages itself
    assert sw.native_server_args(pp_one_node)[-2:] == ["--pipeline-parallel-size", "2"]
    tp_pp = load_sweep_config(write(tmp_path, single_node(pipeline_parallel_size="2")))
    sw.check_can_launch(tp_pp)  # TP 8 inside each of 2 stages: atomc serve -tp 8 -pp 2 on one machine
    tp_pp.server_args = []
    assert sw.native_server_args(tp_pp)[-4:] == ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
    pp_native = single_node(nnodes="2", master_addr="h", pipeline_parallel_size="2")
    with pytest.raises(SweepConfigError, match="driver='atom' with nnodes > 1 cannot run pipeline parallel"):
        load_sweep_config(write(tmp_path, pp_native))


def test_unused_lab_fields_are_noted(tmp_path):
    data = single_node()
    data["container"] = {"image": "rocm/atom"}
    data["roles"]["server"].update(ib_netdev="eth0", env={"A": "1"})
    cfg = load_sweep_config(write(tmp_path, data))
    assert any(n.startswith("container is not used") for n in cfg.notes)
    assert any("ib_netdev is not used" in n for n in cfg.notes)
    assert cfg.server_env == {"A": "1"}  # passed to atomc serve
    data["roles"]["server"]["atom_argz"] = "x"
    with pytest.raises(SweepConfigError, match="unknown roles.server fields \\['atom_argz'\\]"):
        load_sweep_config(write(tmp_path, data))


def test_shipped_profiles_example_loads_and_is_covered():
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "bench" / "profiles" / "tiny_atom_profiles.json"
    for profile, blocks in (("perf", {"functional", "platform"}), ("mtp3", {"functional", "mtp_quality"})):
        cfg = load_sweep_config(example, profile)
        assert set(cfg.blocks) == blocks and cfg.notes == []
        thresholds = load_thresholds(resolve_threshold_path(cfg, None), profile)
        assert check_thresholds(cfg, thresholds, enforce=True) == []
        assert {c.key for c in cfg.cells} == {k for k in thresholds if k.startswith("ISL=")}
