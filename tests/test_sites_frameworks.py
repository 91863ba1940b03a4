"""Sites under the training frameworks and in a prediction, end to end with the real libraries:
the step spans that the Hugging Face ``Trainer``, Lightning and accelerate adapters open carry
the sites of their bytes, named in the model's own code (``transformers/models/gpt2/modeling_gpt2.py``
when ``transformers`` is included, the user's module otherwise) to the line and the byte; a step
that grew against its baseline under Lightning is run again with sites and its failure names the
line; and a Llama-7B predicted on fake tensors that does not fit names the line of
``modeling_llama.py`` that allocates the largest activation.

The sessions run in processes of their own: importing a framework in the suite's process (its
tensors, its threads) would change what later tests measure. The tests share two sessions,
run once for the module (:func:`runs`): the baselines, whose update records every step's sites
in the test's only run, and the run in which two steps grew, with the Llama-7B."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from conftest import needs
from tests._sessions_batch import Ran, Session, run_batch

ROOT = Path(__file__).resolve().parent.parent

F32 = 4


def _line(source: str, text: str) -> int:
    """The number of the line of ``source`` that holds ``text`` (once)."""
    found = [number for number, line in enumerate(source.splitlines(), 1) if text in line]
    assert len(found) == 1, (text, found)
    return found[0]


def _installed(relative: str) -> str:
    """The source of ``relative`` (``transformers/models/...``) as installed, read without importing it."""
    spec = importlib.util.find_spec(relative.split("/")[0])
    assert spec is not None and spec.submodule_search_locations
    folder = Path(next(iter(spec.submodule_search_locations))).parent
    return (folder / relative).read_text(encoding="utf-8")


def _sites(test: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each span's sites, by the span's name (spans without sites left out)."""
    return {m["name"]: m["sites"]["sites"] for m in test["measurements"] if m.get("sites")}


def _at(sites: list[dict[str, Any]], code: str) -> dict[str, Any]:
    """The only site among ``sites`` whose source line is ``code``."""
    found = [site for site in sites if site["code"] == code]
    assert len(found) == 1, (code, [s["code"] for s in sites])
    return found[0]


TRAINER = """\
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pytest_gpumem.integrations.transformers import GpumemCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.mark.gpumem
def test_trainer(gpumem, tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=4,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[GpumemCallback(gpumem)]).train()
"""

GPT2 = "transformers/models/gpt2/modeling_gpt2.py"


@pytest.mark.slow
def test_a_trainers_step_spans_name_lines_of_modeling_gpt2_when_transformers_is_included(
    runs: dict[str, Ran],
) -> None:
    needs("transformers")
    test = _passed(runs["baselines"], "test_hf_sites.py::test_trainer")
    spans = _sites(test)
    assert list(spans) == ["call", "step1", "step2"]
    source = _installed(GPT2).splitlines()
    for name in ("step1", "step2"):
        model = [site for site in spans[name] if site["file"] == GPT2]
        assert model, [site["file"] for site in spans[name]]
        for site in model:  # each names its line as the installed file has it
            assert " ".join(source[site["line"] - 1].split()).startswith(site["code"].rstrip("…"))
        # the first LayerNorm's output, saved for the attention's projection, with its mean and
        # rstd (saved for its own backward): alive at the step's peak, to the byte
        norm = _at(model, "hidden_states = self.ln_1(hidden_states)")
        assert (norm["function"], norm["category"], norm["phase"]) == ("GPT2Block.forward", "activations", "forward")
        assert norm["peak"] == 4 * 16 * 32 * F32 + 2 * 4 * 16 * F32
        assert norm["examples"][0] == "(4, 16, 32) float32"


CALLBACK_IN_A_FIXTURE = """\
import os

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from pytest_gpumem.integrations.transformers import GpumemCallback


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


@pytest.fixture
def callback(gpumem):
    return GpumemCallback(gpumem)


@pytest.mark.gpumem
def test_trainer(callback, tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=2,
        per_device_train_batch_size=int(os.environ.get("HF_BATCH", "4")),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback]).train()
"""


@pytest.mark.slow
def test_a_callback_made_in_a_fixture_names_its_steps_and_tracks_the_model_again_in_the_second_run(
    runs: dict[str, Ran],
) -> None:
    """The second run of a failing test reuses its fixtures' values: a callback made in a fixture
    is the first run's, and the test makes a new trainer, model and optimizer. The callback's steps
    count from ``step1`` again (not ``step3``, which no span of the first run is: the steps would
    get no sites), and it tracks the new model and optimizer (else the second run's sites would
    not know the parameters, the gradients and the activations)."""
    needs("transformers")
    nodeid = "test_hf_callback.py::test_trainer"
    _passed(runs["baselines"], nodeid)  # at a batch of 4
    test = _failed(runs["grown"], nodeid)  # at 8
    steps = {m["name"]: m for m in test["measurements"] if m["name"].startswith("step")}
    assert list(steps) == ["step1", "step2"]
    for name, step in steps.items():
        assert step["sites"]["second_run"], name
        changes = test["site_changes"][name]["changes"]
        gelu = next(c for c in changes if c["site"]["function"] == "NewGELUActivation.forward")
        site = gelu["site"]
        assert (site["file"], site["category"], site["phase"], gelu["status"]) == (
            "transformers/activations.py",
            "activations",
            "forward",
            "changed",
        )
        # the tanh-approximated GELU keeps three (batch, 16, 128) float32 tensors: four more rows
        assert gelu["delta"]["peak"] == 3 * 4 * 16 * 128 * F32
        assert any(c["site"]["file"] == GPT2 for c in changes)
    assert "[step1] at the peak, against the baseline (sites by growth):" in runs["grown"].section("test_trainer")


LIGHTNING = """\
import os

import lightning as L
import pytest
import torch

from pytest_gpumem.integrations.lightning import GpumemCallback

BATCH = int(os.environ.get("SITES_BATCH", "512"))


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)

    def training_step(self, batch, batch_idx):
        x, targets = batch
        hidden = torch.nn.functional.gelu(self.up(x))
        return torch.nn.functional.mse_loss(self.down(hidden), targets)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.gpumem
def test_fit(gpumem, tmp_path):
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(2048, 32), torch.randn(2048, 32))
    trainer = L.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        callbacks=[GpumemCallback(gpumem)],
        default_root_dir=tmp_path,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=BATCH))
"""

#: The line of the LightningModule (and of the accelerate model) that makes the widest activations:
#: the projection's output (saved by the GELU) and the GELU's (saved by the second projection).
WIDE = "hidden = torch.nn.functional.gelu(self.up(x))"


def _wide_bytes(batch: int) -> int:
    return 2 * batch * 128 * F32


@pytest.mark.slow
def test_a_lightning_fits_step_spans_name_the_line_of_the_lightning_module(runs: dict[str, Ran]) -> None:
    needs("lightning")
    test = _passed(runs["baselines"], "test_pl_sites.py::test_fit")
    spans = _sites(test)
    assert list(spans) == ["call", "step1", "step2"]
    for name in ("step1", "step2"):
        wide = _at(spans[name], WIDE)
        where = ("test_pl_sites.py", _line(LIGHTNING, WIDE), "Regressor.training_step")
        assert (wide["file"], wide["line"], wide["function"]) == where
        assert (wide["category"], wide["phase"], wide["count"]) == ("activations", "forward", 2)
        assert wide["peak"] == _wide_bytes(512)
        assert wide["examples"] == ["(512, 128) float32"]


@pytest.mark.slow
def test_a_lightning_step_that_grew_is_run_again_and_its_failure_names_the_line(runs: dict[str, Ran]) -> None:
    """The default ``rerun`` mode: the step spans' baselines are recorded (with their sites), the
    batch doubles, the test fails against them and runs once more with sites on: the second
    run's callbacks open the same step spans, whose sites name the LightningModule's line."""
    needs("lightning")
    nodeid = "test_pl_sites.py::test_fit"
    _passed(runs["baselines"], nodeid)  # at a batch of 512
    test = _failed(runs["grown"], nodeid)  # at 1,024
    step = next(m for m in test["measurements"] if m["name"] == "step1")
    assert step["sites"]["second_run"]
    changes = test["site_changes"]["step1"]["changes"]
    wide = next(change for change in changes if change["site"]["code"] == WIDE)
    line = _line(LIGHTNING, WIDE)
    assert (wide["site"]["line"], wide["site"]["function"], wide["status"]) == (
        line,
        "Regressor.training_step",
        "changed",
    )
    assert wide["delta"]["peak"] == _wide_bytes(1024) - _wide_bytes(512)
    assert max(changes, key=lambda change: change["delta"]["peak"]) is wide  # the largest growth
    text = runs["grown"].section("test_fit")
    assert "[step1] peak cost 1.64 MiB regressed from baseline 848.14 KiB" in text
    table = text.split("[step1] at the peak, against the baseline (sites by growth):", 1)[1].split("[step2]")[0]
    row = table.splitlines()[3]  # the first below the header and its rule: the largest growth
    assert f"test_pl_sites.py:{line} Regressor.training_step" in row
    assert row.split()[:3] == ["+512.00", "KiB", "activations"] and WIDE in row and "(1024, 128) float32" in row
    assert "sites from a second run" in table


ACCELERATE = """\
import accelerate
import pytest
import torch

from pytest_gpumem.integrations.accelerate import track


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(32, 128)
        self.down = torch.nn.Linear(128, 32)

    def forward(self, x):
        hidden = torch.nn.functional.gelu(self.up(x))
        return self.down(hidden)


@pytest.mark.gpumem
def test_loop(gpumem):
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = MLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 32), torch.randn(1024, 32))
    loader = torch.utils.data.DataLoader(data, batch_size=512)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    track(gpumem, model, optimizer)
    for step, (inputs, targets) in enumerate(loader, 1):
        with gpumem.measure(f"step{step}"):
            accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            optimizer.zero_grad()
"""


@pytest.mark.slow
def test_an_accelerate_loops_step_spans_name_the_line_of_the_model(runs: dict[str, Ran]) -> None:
    needs("accelerate")
    test = _passed(runs["baselines"], "test_acc_sites.py::test_loop")
    spans = _sites(test)
    assert list(spans) == ["call", "step1", "step2"]
    for name in ("step1", "step2"):
        wide = _at(spans[name], WIDE)
        assert (wide["file"], wide["line"], wide["function"]) == (
            "test_acc_sites.py",
            _line(ACCELERATE, WIDE),
            "MLP.forward",
        )
        assert (wide["category"], wide["phase"], wide["count"]) == ("activations", "forward", 2)
        assert wide["peak"] == _wide_bytes(512)


LLAMA = """\
import pytest
import torch
import transformers

LLAMA_7B = transformers.LlamaConfig(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    vocab_size=32000,
    max_position_embeddings=4096,
)


@pytest.mark.gpumem(predict="h100", fake=True, peak="80GB")
def test_a_batch_of_four_fits_an_h100(gpumem):
    model = transformers.LlamaForCausalLM(LLAMA_7B)
    optimizer = torch.optim.AdamW(model.parameters())
    gpumem.track(model, optimizer)
    batch = torch.randint(0, LLAMA_7B.vocab_size, (4, 2048))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
"""

LLAMA_FILE = "transformers/models/llama/modeling_llama.py"


@pytest.mark.slow
def test_a_llama_7b_that_does_not_fit_names_the_line_that_allocates_the_largest_activation(
    runs: dict[str, Ran],
) -> None:
    """The real Llama-7B config (32 layers, d = 4,096, SwiGLU 11,008), a full fine-tune step on
    fake tensors predicted for an H100: bf16 autocast, fp32 AdamW, 4 × 2,048 tokens. Its peak is
    at the end of the forward pass (the activations of 32 layers), beyond the 80 GB limit; on
    fake tensors the test's only run records its sites, and the failure's table of the largest
    sites at the peak starts with the MLP's line in ``modeling_llama.py``. docs/sites.md shows
    this module and this failure: the same text, to the character."""
    needs("transformers")
    test = _failed(runs["grown"], "test_llama_fit.py::test_a_batch_of_four_fits_an_h100")
    sites = _sites(test)["call"]
    activations = [site for site in sites if site["category"] == "activations"]
    largest = max(activations, key=lambda site: site["peak"])
    assert max(sites, key=lambda site: site["peak"]) is largest  # the largest site at the peak
    source = _installed(LLAMA_FILE)
    code = "down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"
    line = _line(source, code)
    assert (largest["file"], largest["line"], largest["function"]) == (LLAMA_FILE, line, "LlamaMLP.forward")
    assert code.startswith(largest["code"].rstrip("…"))
    # in each of the 32 layers, eight bf16 tensors kept for backward: the outputs of gate_proj and
    # up_proj and their product, the two bf16 copies of the input that the projections take, and
    # autocast's bf16 copies of the three weights
    tokens, width, wide = 4 * 2048, 4096, 11008
    per_layer = 3 * tokens * wide * 2 + 2 * tokens * width * 2 + 3 * wide * width * 2
    assert (largest["phase"], largest["count"], largest["peak"]) == ("forward", 32 * 8, 32 * per_layer)
    assert "(4, 2048, 11008) bfloat16" in largest["examples"]
    text = runs["grown"].section("test_a_batch_of_four_fits_an_h100")
    failure = text.split("exceeds the limit 80.00 GiB (80GB)", 1)[1]
    table = failure.split("at the peak, the largest sites:", 1)[1].splitlines()
    first = table[3]  # below the header and its rule
    assert first.split()[:4] == ["28.19", "GiB", "activations", "forward"]
    assert f"{LLAMA_FILE}:{line} LlamaMLP.forward" in first
    assert "down_proj = self.down_proj(self.act_fn(self.gat" in first and largest["examples"][0] in first
    assert "sites from a second run" not in failure  # on fake tensors the first run records them
    source, shown = _in_the_docs()
    assert source == LLAMA
    assert _show(text, "peak cost") == shown


def _in_the_docs() -> tuple[str, str]:
    """docs/sites.md's Llama-7B module, and the failure it shows (the block after the command)."""
    document = (ROOT / "docs" / "sites.md").read_text(encoding="utf-8")
    source = document.split('Path("sites/test_llama_fit.py").write_text("""\n', 1)[1].split('""")', 1)[0]
    command = '>>> show(pytest("test_llama_fit.py", "--gpumem-sites-include=transformers", columns=200), "peak cost")\n'
    return source, document.split(command, 1)[1].split("```", 1)[0].rstrip("\n")


def _show(output: str, first: str) -> str:
    """docs/sites.md's ``show(output, first)``: from the line that starts with ``first`` to the next empty one."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(first))
    end = next(i for i, line in enumerate(lines) if i > start and not line)
    return "\n".join(line.rstrip() for line in lines[start:end])


def _passed(ran: Ran, nodeid: str) -> dict[str, Any]:
    """The JSON report's entry of ``nodeid``, which passed in ``ran``."""
    assert ran.outcome(nodeid) == "passed", ran.result.stdout.str()[-6000:]
    return ran.test(nodeid)


def _failed(ran: Ran, nodeid: str) -> dict[str, Any]:
    """The JSON report's entry of ``nodeid``, which failed in ``ran``."""
    assert ran.outcome(nodeid) == "failed", ran.result.stdout.str()[-6000:]
    return ran.test(nodeid)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest) -> dict[str, Ran]:
    """The module's two sessions, by name, with the frameworks installed: ``baselines`` (their update
    records every step's sites: the Trainer, Lightning and accelerate, and the callback made in a
    fixture, batches of 4 and 512) and ``grown`` (the callback's and Lightning's, 8 and 1,024, with
    the Llama-7B), one row a site (200 columns)."""
    has = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "lightning", "accelerate")}
    include = "--gpumem-sites-include=transformers"
    recorded = {"test_hf_sites.py": TRAINER} if has["transformers"] else {}
    recorded |= {"test_acc_sites.py": ACCELERATE} if has["accelerate"] else {}
    grows = {"test_pl_sites.py": LIGHTNING} if has["lightning"] else {}
    grows |= {"test_hf_callback.py": CALLBACK_IN_A_FIXTURE} if has["transformers"] else {}
    llama = {"test_llama_fit.py": LLAMA} if has["transformers"] else {}
    columns = {"COLUMNS": "200"}
    sessions = {
        "baselines": Session(("--gpumem-update-baselines", include), recorded | grows, columns),
        "grown": Session((include,), grows | llama, {**columns, "SITES_BATCH": "1024", "HF_BATCH": "8"}),
    }
    sessions = {name: session for name, session in sessions.items() if session.modules}
    return dict(zip(sessions, run_batch(request, "sites-frameworks", list(sessions.values())), strict=True))
