"""A Hugging Face ``Trainer`` under the marker: three steps of a tiny GPT-2 built from a config
(nothing is downloaded), with a peak limit and a model-state budget in Ψ."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from pytest_gpumem.integrations.transformers import GpumemCallback  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """24 sequences of 32 random token ids, their own labels (a language-modelling batch)."""

    def __init__(self) -> None:
        self.ids = torch.randint(0, 128, (24, 32), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


# What stays allocated after training: the parameters (4Ψ) and AdamW's exp_avg and exp_avg_sq
# (8Ψ); the trainer sets the gradients to None after each step. The 32 KiB hold the rest. On
# the CPU: AdamW's step counters (4 B per parameter tensor), the data set's token ids (6 KiB)
# and the trainer's loss. On a CUDA GPU (an H200): the caching allocator's 512-byte blocks
# (the 64-float LayerNorm weights and biases take 512 B each, in each of the three copies:
# 12 KiB), the fused AdamW the trainer picks there, whose step counters live on the device
# (28 × 512 B), and the loss: 26.5 KiB.
@pytest.mark.gpumem(peak="16MiB", allocated="12Ψ + 32KiB")
def test_trainer_three_steps(gpumem, tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=8,
        use_cpu=gpumem.device.type == "cpu",
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[GpumemCallback(gpumem)])
    trainer.train()
    assert [span.name for span in gpumem.spans] == ["step1", "step2", "step3"]
