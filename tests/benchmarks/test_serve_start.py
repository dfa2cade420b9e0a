"""benchmarks/serve_start.py's breakdown of a server's start-up lines into phases (no server runs)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serve_start  # noqa: E402

# the lines of a warm GPU start, in the format the server and the engine log them
WARM = [
    (0.56, "INFO atomc.serve: start-up: listening on 127.0.0.1:43057; loading the model"),
    (1.31, "INFO atomc.serve: start-up: HTTP side imported in 0.8s"),
    (3.77, "... INFO atomc.serve[engine]: start-up: engine process spawned in 0.1s, engine imports 3.1s"),
    (4.07, "... INFO atomc.engine.llm_engine[engine]: start-up: model folder 0.2s, tokenizer 0.1s (llama-3.1-8b)"),
    (9.9, "... INFO atomc.engine.llm_engine[engine]: start-up: imports 3.0s (backend ops, compiler), weights 1.2s "
     "(CUDA context 0.8s on a thread, overlapped with the imports; 0.1s waited), model (artifact loaded) 1.6s "
     "(cache key and checks 0.5s, load 1.1s), KV sizing 0.4s (on a GPU the first forward, with the kernels' "
     "first-use compiles), KV cache (55986 blocks): 6.2s in all"),
    (11.9, "... INFO atomc.engine.llm_engine[engine]: start-up: CUDA graphs captured in 2.0s"),
    (11.9, "... INFO atomc.engine.llm_engine[engine]: start-up: engine ready in 8.1s"),
    (11.9, "INFO atomc.serve: start-up: server-side tokenizer 9.7s, overlapped with the engine's start"),
    (11.9, "INFO atomc.serve: serving llama-3.1-8b (max_model_len 4096) on http://127.0.0.1:43057; loaded in 11.4s"),
    (12.0, "INFO some.other.logger: weights 99.0s in a line that is no start-up line"),
]  # fmt: skip


def test_a_warm_gpu_start_breaks_into_its_phases():
    got = {p["phase"]: (p["seconds"], p["at"]) for p in serve_start.phase_breakdown(WARM)}
    assert got["listening"] == (None, 0.56)
    assert got["engine imports"] == (3.1, 3.77) and got["engine spawn"] == (0.1, 3.77)
    assert got["imports: backend ops, compiler"][0] == 3.0
    assert got["CUDA context (thread)"][0] == 0.8 and got["CUDA context waited"][0] == 0.1
    assert got["weights"][0] == 1.2 and got["model"][0] == 1.6
    assert got["cache key and checks"][0] == 0.5 and got["artifact load"][0] == 1.1
    assert got["KV sizing"][0] == 0.4 and got["CUDA graphs"] == (2.0, 11.9)
    assert got["serving"][0] == 11.4
    names = [p["phase"] for p in serve_start.phase_breakdown(WARM)]
    assert names == [n for n, _ in serve_start.PHASES]  # every phase, in start-up order


def test_a_cpu_start_leaves_out_what_it_has_not_and_marks_overlaps():
    cpu = [(t, ln) for t, ln in WARM if "CUDA graphs" not in ln]
    context = " (CUDA context 0.8s on a thread, overlapped with the imports; 0.1s waited)"
    cpu = [(t, ln.replace(context, "")) for t, ln in cpu]
    phases = serve_start.phase_breakdown(cpu)
    names = [p["phase"] for p in phases]
    assert "CUDA graphs" not in names and "CUDA context (thread)" not in names and "weights" in names
    rows = serve_start.format_breakdown(phases)
    assert any("server-side tokenizer" in r and r.endswith("(overlapped)") for r in rows)
    assert any("artifact load" in r and r.endswith("(part of the above)") for r in rows)


def test_bytecode_cache_is_filled_and_handed_to_the_servers(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    calls = []
    monkeypatch.setattr(serve_start.subprocess, "run", lambda cmd, check: calls.append((cmd, dict(os.environ))))
    serve_start.fill_bytecode_cache(str(tmp_path))
    (cmd, child_env), = calls
    assert "import_compiler" in cmd[-1] and "atomc.serve.server" in cmd[-1]
    assert child_env["PYTHONPYCACHEPREFIX"] == str(tmp_path) and "PYTHONDONTWRITEBYTECODE" not in child_env
    assert os.environ["PYTHONPYCACHEPREFIX"] == str(tmp_path)  # the servers started after inherit it
