"""GPU-side machinery behind the CPU interfaces: static-shape steps that a CUDA graph can capture,
and timers that measure device work rather than launch time. Every piece also runs on a CPU (eagerly),
so its bookkeeping is tested without a GPU."""
