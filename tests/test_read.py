"""Store.rollouts: committed rows back as Rollout objects, by run, step and sample id."""

from __future__ import annotations

import pytest

import mmstore
from tests.rows import commit
from tests.store_workers import image_bytes


@pytest.fixture
def written(store, adapter):
    media = [store.put_media(image_bytes(i)) for i in range(2)]
    commit(store, adapter, "a", 0, [[media[0]], []])
    commit(store, adapter, "a", 1, [[media[1], media[0]]])
    commit(store, adapter, "b", 0, [[]])
    return store


def ids(rollouts):
    return [r.sample_id for r in rollouts]


def test_rollouts_round_trip_and_select(written):
    everything = written.rollouts()
    assert ids(everything) == ["a-0-0", "a-0-1", "a-1-0", "b-0-0"]
    assert all(isinstance(r, mmstore.Rollout) for r in everything)
    assert len(everything[2].images) == 2 and everything[2].images[1].offset > 0
    assert ids(written.rollouts(run_id="a", step=1)) == ["a-1-0"]
    assert ids(written.rollouts(step=0)) == ["a-0-0", "a-0-1", "b-0-0"]
    assert ids(written.rollouts(sample_ids=["b-0-0", "a-0-1"])) == ["a-0-1", "b-0-0"]
    assert written.rollouts(run_id="a", sample_ids="a-0-0")[0] == everything[0]


def test_rollouts_feed_the_vllm_helper(written):
    from mmstore.integrations import vllm

    rollout = written.rollouts(run_id="a", step=1, sample_ids="a-1-0")[0]
    prompt = vllm.to_vllm_prompt(written, rollout)
    assert len(prompt["multi_modal_data"]["image"]) == 2


@pytest.mark.parametrize(
    ("selection", "needle"),
    [
        ({"run_id": "typo"}, "no run 'typo'"),
        ({"run_id": "a", "step": 7}, "step 7"),
        ({"sample_ids": ["a-0-0", "nope"]}, "sample ids ['nope']"),
        ({"run_id": "b", "sample_ids": ["a-0-0"]}, "sample ids ['a-0-0']"),
    ],
)
def test_rollouts_matching_nothing_raise(written, selection, needle):
    with pytest.raises(mmstore.NoMatchError) as err:
        written.rollouts(**selection)
    assert needle in str(err.value)


def test_an_empty_store_has_no_rollouts(store):
    with pytest.raises(mmstore.NoMatchError):
        store.rollouts()
