"""The family registry: a third party plugs a family in and trains through it; fingerprints
keep families apart; stores holding several families stay readable for people.

A new family is one case plus its quirks. For a family with a transformers processor and
model, that is one :class:`tests.family_cases.FamilyCase` added to ``CASES`` (its image
processor classes, its full processor over an offline tokenizer with published and small
token ids, the chat template's text for one image, sizes to check, a tiny random-weight
model), and every test of ``tests/test_family_contract.py`` runs on it; a
``tests/test_family_<name>.py`` keeps what only that family does. The toy family below is not
such a case: the contract checks each family against its real full processor (text and
images to token ids and tensors) and its transformers model (outputs with ``loss`` and
``logits``, packed and alone), and the toy has neither; so this file keeps the registry's own
tests, through the toy's image processor and a toy model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from PIL import Image

import mmstore
from mmstore import Family
from mmstore.synth import screenshot

BOI, IMG, EOI, PAD = 90, 91, 92, 0


class ToyImageProcessor:
    """A third party's image processor: one 4-dim feature row per 16x16 cell."""

    def __init__(self, cell: int = 16) -> None:
        self.cell = cell

    def __call__(self, images: list[Image.Image], return_tensors: str = "np") -> dict[str, Any]:
        rows = []
        for image in images:
            w, h = image.size
            pooled = np.asarray(image.convert("RGB").resize(_cells(w, h, self.cell)), np.float32)
            rows.append(
                np.concatenate([pooled.reshape(-1, 3) / 255.0, np.ones((pooled.size // 3, 1))], 1)
            )
        return {"pixel_values": np.concatenate(rows).astype(np.float32)}


def _cells(width: int, height: int, cell: int) -> tuple[int, int]:
    return max(1, math.ceil(width / cell)), max(1, math.ceil(height / cell))


class ToyFamily(Family):
    name = "toy"
    parameter_names = ("cell",)
    token_table: ClassVar[Mapping[str, mmstore.Token]] = {
        "image_token_id": mmstore.Token("<boi>", BOI),
        "soft_token_id": mmstore.Token("<img>", IMG),
        "end_token_id": mmstore.Token("<eoi>", EOI),
        "pad_token_id": mmstore.Token("<pad>", PAD),
    }
    image_inputs: ClassVar[Mapping[str, Any]] = {"pixel_values": "cat"}

    @classmethod
    def read_parameters(cls, image_processor: Any, processor: Any) -> dict[str, Any]:
        return {"cell": image_processor.cell}

    def expansion(self, width: int, height: int) -> list[int]:
        n = math.prod(_cells(width, height, self.layout.param("cell")))
        return [BOI, *[IMG] * n, EOI]

    @property
    def feature_token_id(self) -> int:
        return IMG

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset({BOI, IMG, EOI})

    def placeholder(self, width: int, height: int) -> dict[str, np.ndarray]:
        n = math.prod(_cells(width, height, self.layout.param("cell")))
        return {"pixel_values": np.zeros((n, 4), np.float32)}

    @property
    def dummy_size(self) -> tuple[int, int]:
        return 1, 1

    def output_tokens(self, outputs: Mapping[str, Any]) -> int:
        return int(outputs["pixel_values"].shape[0]) + 2


class ToyModel(torch.nn.Module):
    """Image feature rows replace the embeddings of the soft tokens, as VLMs do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(128, 8)
        self.vision = torch.nn.Linear(4, 8)
        self.head = torch.nn.Linear(8, 128)

    def forward(self, input_ids, attention_mask, pixel_values) -> torch.Tensor:
        hidden = self.embed(input_ids)
        mask = input_ids == IMG
        assert int(mask.sum()) == pixel_values.shape[0], "image tokens and pixel rows disagree"
        hidden = hidden.masked_scatter(mask[..., None], self.vision(pixel_values.float()))
        return self.head(hidden * attention_mask[..., None])


@pytest.fixture(scope="module")
def toy() -> type[ToyFamily]:
    mmstore.register_family(ToyFamily, processors=(ToyImageProcessor,))
    return ToyFamily


def test_a_registered_family_trains_one_batch(toy, tmp_path):
    processor = ToyImageProcessor()
    adapter = mmstore.adapter_for(processor)
    assert isinstance(adapter, ToyFamily) and adapter.family == "toy"
    store = mmstore.Store.open(tmp_path / "s", create=True)
    with store.writer(run_id="toy", step=0) as w:
        for i, size in enumerate([(40, 20), (16, 16), (33, 70)]):
            media = store.put_image(screenshot(i, *size))
            tokens, refs = adapter.expand([5, BOI, 6, 7], [media])
            w.write(
                mmstore.Rollout(
                    sample_id=f"s{i}",
                    tokens=tokens,
                    prompt_len=2,
                    loss_mask=[0, *[0] * (len(tokens) - 3), 1, 1],
                    images=refs,
                    reward=1.0,
                )
            )
        w.write(mmstore.Rollout(sample_id="t", tokens=[5, 6, 7], prompt_len=1, loss_mask=[0, 1, 1]))
    loader = mmstore.RolloutLoader(
        mmstore.RolloutDataset(store, processor, dtype=torch.float32, shuffle=False),
        batch_size=2,
        dummy_image=True,
    )
    assert loader.model_input_names == ("input_ids", "attention_mask", "pixel_values")
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for batch in loader:
        logits = model(**{k: batch[k] for k in loader.model_input_names})
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1][batch["loss_mask"][:, 1:]],
            batch["input_ids"][:, 1:][batch["loss_mask"][:, 1:]],
        )
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen += batch["sample_ids"]
    assert seen == ["s0", "s1", "s2", "t"]


def test_a_shifted_span_of_a_registered_family_is_refused(toy, tmp_path):
    adapter = mmstore.adapter_for(ToyImageProcessor())
    store = mmstore.Store.open(tmp_path / "s", create=True)
    media = store.put_image(screenshot(0, 40, 20))
    tokens, [ref] = adapter.expand([5, BOI, 6], [media])
    shifted = ref.model_copy(update={"offset": ref.offset + 1})
    with store.writer(run_id="toy", step=0) as w, pytest.raises(mmstore.InvalidRolloutError):
        w.write(
            mmstore.Rollout(
                sample_id="x",
                tokens=[*tokens, 6],
                prompt_len=1,
                loss_mask=[0] * (len(tokens) + 1),
                images=[shifted],
            )
        )


def test_fingerprints_keep_families_apart(toy, tmp_path, small_processor):
    toy_adapter = mmstore.adapter_for(ToyImageProcessor())
    qwen = mmstore.adapter_for(small_processor)
    assert toy_adapter.fingerprint != qwen.fingerprint
    store = mmstore.Store.open(tmp_path / "s", create=True)
    media = store.put_image(screenshot(0, 40, 20))
    with store.writer(run_id="toy", step=0) as w:
        tokens, refs = toy_adapter.expand([BOI], [media])
        w.write(
            mmstore.Rollout(
                sample_id="a", tokens=tokens, prompt_len=0, loss_mask=[1] * len(tokens), images=refs
            )
        )
    with pytest.raises(mmstore.LayoutMismatchError):
        mmstore.RolloutDataset(store, small_processor)


def test_a_store_of_several_families_summarizes(toy, tmp_path, small_processor):
    store = mmstore.Store.open(tmp_path / "s", create=True)
    media = store.put_image(screenshot(0, 64, 48))
    for run, adapter in (
        ("q", mmstore.adapter_for(small_processor)),
        ("t", mmstore.adapter_for(ToyImageProcessor())),
    ):
        with store.writer(run_id=run, step=0) as w:
            tokens, refs = adapter.expand([1, adapter.image_token_id], [media])
            w.write(
                mmstore.Rollout(
                    sample_id="a",
                    tokens=tokens,
                    prompt_len=1,
                    loss_mask=[0] * len(tokens),
                    images=refs,
                )
            )
    summary = mmstore.debug.summary(store, by=["run_id"])
    rows = {r["run_id"]: r for r in summary.to_dicts()}
    assert set(rows) == {"q", "t"}
    toy_rows = math.prod(_cells(64, 48, 16))
    assert rows["t"]["dense_fp32_bytes"] == toy_rows * 4 * 4
    assert (
        rows["q"]["dense_fp32_bytes"]
        == int(np.prod(mmstore.adapter_for(small_processor).pixel_shape(64, 48))) * 4
    )


def test_registering_a_taken_name_or_processor_is_refused(toy):
    class Other(ToyFamily):
        pass

    with pytest.raises(mmstore.InvalidArgumentError, match="already registered"):
        mmstore.register_family(Other)
    # A refused registration changes nothing: "toy" still builds the toy family.
    assert type(mmstore.adapter_for(ToyImageProcessor())) is ToyFamily
    with pytest.raises(mmstore.InvalidArgumentError, match="another family"):
        mmstore.register_family(Other, processors=(ToyImageProcessor,), name="toy2")
    with pytest.raises(mmstore.InvalidArgumentError, match="not an mmstore Family"):
        mmstore.register_family(int)  # type: ignore[arg-type]
