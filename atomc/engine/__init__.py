"""The engine core on the host: requests in, outputs out, one step at a time (engine -> scheduler ->
block manager; the model runner below it does the device work). Used by `LLM`, the server and the
benchmarks alike; it knows nothing of HTTP."""
