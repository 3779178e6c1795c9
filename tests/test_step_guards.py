"""The guards a compiled step evaluates per call (gpu/inductor.py, `guard_filter`): a frozen step's
module guards go (the module's tensors are held as constants: replacing one neither recompiles nor is
read, where dynamo's default guards recompile), its guards on the inputs, their shapes and the global
state stay, and what the filter stops guarding GraphedSteps checks itself (`weights_key`); a live step
keeps every guard."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from rollout_ssd.gpu.graphs import weights_key
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


def test_the_weights_key_that_replaces_the_dropped_guards_sees_every_write_and_replacement():
    """What a frozen step's filter stops guarding (its modules' tensors and children by identity),
    GraphedSteps checks before each step through `weights_key`: each change below must change it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    model[1].register_buffer("scale", torch.ones(4))
    modules = list(model.modules())
    key = weights_key(modules)
    assert weights_key(modules) == key  # nothing changed: the same key

    def changed() -> bool:
        nonlocal key
        new = weights_key(modules)
        moved, key = new != key, new
        return moved

    with torch.no_grad():
        model[0].weight.mul_(2)  # a write in place (update_weights' copy_)
    assert changed()
    model[0].weight = torch.nn.Parameter(model[0].weight.detach().clone())  # a parameter replaced
    assert changed()
    model[1].scale = torch.zeros(4)  # a buffer replaced
    assert changed()
    model[1].scale.add_(1)  # a buffer written
    assert changed()
    model[1] = torch.nn.LayerNorm(4)  # a submodule replaced: its parent's child is another object
    assert changed()
    with torch.no_grad():
        model(torch.randn(2, 4))  # a forward writes nothing
    assert not changed()
    assert guard_filter("live") is None  # a live step keeps every guard: its weights are inputs


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


def test_a_torch_without_the_guard_filter_keeps_every_guard(monkeypatch):
    monkeypatch.delattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe")
    assert guard_filter("frozen") is None and guard_filter("live") is None
