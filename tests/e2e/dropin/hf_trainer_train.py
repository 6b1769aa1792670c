"""A Hugging Face `transformers.Trainer` script as its users write it; launched by torchrun or
`gpuherd run`. The model is a 2-layer Llama built from a config and the data synthetic:
nothing comes from the hub.

Rank 0 prints `step N loss X` (its own loss of each optimizer step) and the parallel mode
Trainer detected.
"""

import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(7))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintingTrainer(Trainer):
    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if self.is_world_process_zero() and model.training:
            value = loss[0] if isinstance(loss, tuple) else loss
            print(f"step {self.state.global_step} loss {value.item():.8f}", flush=True)
        return loss


def main() -> None:
    set_seed(1337)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=4, max_steps=8,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], seed=1337,
                                 ddp_backend="gloo", ddp_find_unused_parameters=False, dataloader_num_workers=0,
                                 disable_tqdm=True)
        trainer = PrintingTrainer(model=model, args=args, train_dataset=Tokens(64, 16, config.vocab_size))
        if trainer.is_world_process_zero():
            print(f"setup {args.parallel_mode} world_size={args.world_size}", flush=True)
        trainer.train()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
