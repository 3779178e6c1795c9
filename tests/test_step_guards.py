"""The guards a compiled step evaluates per call (gpu/inductor.py, `guard_filter`): a frozen step's
module guards go (the module's tensors are held as constants: replacing one neither recompiles nor is
read, where dynamo's default guards recompile), its guards on the inputs, their shapes and the global
state stay; a live step keeps every guard."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from rollout_ssd.gpu.inductor import guard_filter

FLAG = {"on": True}  # a global the traced code reads, as cpu_backend's live flag is


class _Module(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
        self.copies = {"a": torch.ones(4)}  # as WeightCopies.live holds the kernel's copies

    def forward(self, x):
        out = x @ self.w + self.copies["a"]
        return out * 2 if FLAG["on"] else out


def _frozen_like(guards):
    """A module compiled as a frozen step is: under inference mode, with inductor's freezing."""
    counter = CompileCounter()
    module = _Module()
    options = {"guard_filter_fn": guards} if guards else None
    return torch.compile(module, backend=counter, fullgraph=True, options=options), module, counter


def test_a_live_step_keeps_every_guard_and_a_frozen_one_drops_its_modules():
    assert guard_filter("live") is None
    assert guard_filter("frozen") is torch.compiler.skip_guard_on_all_nn_modules_unsafe


def test_a_frozen_steps_module_tensors_are_held_while_its_inputs_shapes_and_globals_stay_guarded():
    x = torch.randn(2, 4)
    with torch.inference_mode(), torch._inductor.config.patch(freezing=True):
        for guards, frames in ((None, 2), (guard_filter("frozen"), 1)):
            torch._dynamo.reset()
            compiled, module, counter = _frozen_like(guards)
            first = compiled(x)
            module.copies["a"] = torch.zeros(4)  # a copy replaced (only a weight write does that: it retires frozen steps)
            out = compiled(x)
            assert counter.frame_count == frames
            assert torch.equal(out, first) == (guards is not None)  # held, not read again, under the filter
        y = torch.randn(3, 4)  # another input shape: a new graph, which takes the copy there is now
        assert torch.allclose(compiled(y), (y @ module.w) * 2) and counter.frame_count == 2
        FLAG["on"] = False
        try:
            assert torch.allclose(compiled(y), y @ module.w) and counter.frame_count == 3
        finally:
            FLAG["on"] = True
