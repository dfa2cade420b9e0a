set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv
git log --oneline | head -1
timeout 200 python -m pytest -q -m gpu tests/graphs/test_signing.py -rxX 2>&1 | tail -8
timeout 200 python benchmarks/serve_start.py --warm 2 --cache-dir /tmp/cc --out $OUT/serve_start.json 2>&1 | tail -60
python - <<'PY'
from pathlib import Path
from atomc.graphs import pickle_scan
for p in Path("/tmp/cc").rglob("model.aot"):
    names, refusals = pickle_scan.audit(p.read_bytes())
    print("AUDIT", p, len(names), "globals;", len(refusals), "refusals")
    for r in refusals: print("  REFUSED", r)
PY
timeout 240 python -m pytest -q -m gpu tests/kernels/test_triton_mla_gpu.py tests/kernels/test_triton_mla_latent_norm_rope_gpu.py 2>&1 | tail -8
timeout 120 python benchmarks/mla_decode.py --out $OUT/mla_decode.json --bs 1,8,64 --ctx 1024,4096 --no-reference 2>&1 | tail -20
