"""Clean names whatever wraps the model: the report must read `layers.0...`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tests.worker.nan.helpers import TinyLM
from torch.nn.parallel import DistributedDataParallel as DDP

from worker.nan.inspect_model import inspect_model
from worker.nan.names import clean_name, named_modules, named_parameters


def test_clean_name_drops_wrapper_components_only():
    assert clean_name("module._orig_mod.layers.0.attention.wq.weight") == "layers.0.attention.wq.weight"
    assert clean_name("_orig_mod.module.tok_embed.weight") == "tok_embed.weight"
    assert clean_name("layers.3._checkpoint_wrapped_module.feed_forward.w1.weight") == "layers.3.feed_forward.w1.weight"
    assert clean_name("_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.ffn_norm.weight") == "layers.0.ffn_norm.weight"
    assert clean_name("modules.module_norm.weight") == "modules.module_norm.weight"  # real names stay
    assert clean_name("module") == clean_name("") == "<model>"


def test_compiled_and_ddp_wrapped_models_report_plain_names(tmp_path):
    torch.manual_seed(0)
    plain = TinyLM()
    expected = [n for n, _ in plain.named_parameters()]
    compiled = torch.compile(plain)  # wrapping only: nothing is compiled until called
    assert [n for n, _ in named_parameters(compiled)] == expected
    assert [f.name for f in inspect_model(compiled).parameters] == expected

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        wrapped = DDP(torch.compile(TinyLM()))
        assert [n for n, _ in named_parameters(wrapped)] == expected
        modules = [n for n, _ in named_modules(wrapped)]
        assert modules[0] == "<model>" and modules.count("<model>") == 1  # wrappers are not layers
        assert "layers.0.feed_forward.w1" in modules and not any("module" == m.split(".")[0] for m in modules)
    finally:
        dist.destroy_process_group()
