"""GPU-side machinery behind the CPU interfaces: static-shape steps that a CUDA graph can capture,
timers that measure device work rather than launch time, and the KV cache's size from a GPU's free
memory. Every piece also runs on a CPU (eagerly, or as plain arithmetic), so its bookkeeping is tested
without a GPU."""
