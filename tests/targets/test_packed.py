"""targets/packed.py's CountedModule: each change made through nn.Module's own methods moves one shared
count (cpu_layers' decode layers compare it instead of walking their modules), and a cache a module
keeps of its own checks does not."""

import torch
from torch import nn

from quantprep.targets.packed import CountedModule


def test_every_change_through_the_module_moves_the_count_and_a_read_does_not():
    m = CountedModule()
    m.register_buffer("codes", torch.zeros(4))
    m.add_module("child", nn.Identity())
    changes = [
        lambda: setattr(m, "codes", torch.ones(4)),  # a buffer replaced
        lambda: m.register_buffer("scales", torch.ones(2)),
        lambda: m.register_parameter("bias", nn.Parameter(torch.zeros(2))),
        lambda: m.add_module("other", nn.Identity()),
        lambda: setattr(m, "forward", lambda x: x),
        lambda: delattr(m, "forward"),
        lambda: m.train(False),
        lambda: m.float(),  # _apply
        lambda: setattr(m, "__class__", type("Sub", (CountedModule,), {})),
    ]
    for change in changes:
        before = CountedModule.changes
        change()
        assert CountedModule.changes > before, change
    before = CountedModule.changes
    _ = m.codes, m.child, m.training, list(m.parameters()), m.state_dict()
    vars(m)["_cache"] = 1  # a module's cache of its own checks (CpuInt4Linear.c_weight)
    assert CountedModule.changes == before


def test_a_forward_hook_s_removal_moves_the_count():
    m = CountedModule()
    for register in (m.register_forward_hook, m.register_forward_pre_hook):
        handle = register(lambda *a: None)
        before = CountedModule.changes
        handle.remove()
        assert CountedModule.changes == before + 1 and not m._forward_hooks and not m._forward_pre_hooks
    with m.register_forward_hook(lambda *a: None):
        before = CountedModule.changes
    assert CountedModule.changes == before + 1
