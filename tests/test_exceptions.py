"""The error tree: every error is an MmstoreError, catchable as the built-in a caller expects,
carries its context as attributes, and survives pickling (DataLoader workers)."""

from __future__ import annotations

import copy
import inspect
import pickle
import traceback

import pytest
from PIL import Image

import mmstore
from mmstore import errors as _exceptions

# (error, the built-in a caller would catch): DESIGN.md's names first, then the rest.
TREE = [
    (mmstore.InvalidRolloutError, ValueError),
    (mmstore.SampleTooLongError, ValueError),
    (mmstore.HashMismatchError, ValueError),
    (mmstore.MediaNotFoundError, FileNotFoundError),
    (mmstore.UntrustedURIError, PermissionError),
    (mmstore.LayoutMismatchError, ValueError),
    (mmstore.SchemaVersionError, ValueError),
    (mmstore.WireFormatError, ValueError),
    (mmstore.UnsupportedProcessorError, TypeError),
    (mmstore.ImageSizeError, ValueError),
    (mmstore.NotAStoreError, FileNotFoundError),
    (mmstore.ImageDecodeError, ValueError),
    (mmstore.DecompressionBombError, ValueError),
    (mmstore.VideoDecodeError, ValueError),
    (mmstore.VideoBombError, ValueError),
    (mmstore.InvalidArgumentError, ValueError),
    (mmstore.CorruptFileError, ValueError),
    (mmstore.NoMatchError, LookupError),
    (mmstore.RunNotFoundError, LookupError),
    (mmstore.StepNotCommittedError, LookupError),
    (mmstore.DestinationExistsError, FileExistsError),
    (mmstore.DeleteFailedError, OSError),
    (mmstore.TableNotFoundError, FileNotFoundError),
    (mmstore.TableVersionError, LookupError),
    (mmstore.TableConflictError, RuntimeError),
    (mmstore.ProducerConflictError, ValueError),
    (mmstore.TableForkError, RuntimeError),
    (mmstore.MediaPermissionError, PermissionError),
    (mmstore.NetworkError, ConnectionError),
    (mmstore.UpgradeRequiredError, ValueError),
    (mmstore.VersionMismatchError, RuntimeError),
    (mmstore.PinnedRowsError, RuntimeError),
    (mmstore.LiveTimeoutError, TimeoutError),
    (mmstore.LiveFinishedError, EOFError),
    (mmstore.WorkerDiedError, RuntimeError),
    (mmstore.UnknownLayoutError, mmstore.InvalidRolloutError),
]

ALL_ERRORS = [
    obj
    for obj in vars(_exceptions).values()
    if inspect.isclass(obj) and issubclass(obj, mmstore.MmstoreError)
]


@pytest.mark.parametrize(("error", "builtin"), TREE, ids=[e.__name__ for e, _ in TREE])
def test_error_is_an_mmstore_error_and_its_builtin(error, builtin):
    err = error("boom", sample_id="s1")
    assert isinstance(err, mmstore.MmstoreError)
    assert isinstance(err, builtin)
    with pytest.raises(builtin):
        raise err


def test_media_errors_share_a_parent():
    assert issubclass(mmstore.MediaNotFoundError, mmstore.MediaError)
    assert issubclass(mmstore.HashMismatchError, mmstore.MediaError)
    assert issubclass(mmstore.DecompressionBombError, mmstore.ImageDecodeError)
    # A video bomb is caught by either handler a caller already has.
    assert issubclass(mmstore.VideoBombError, mmstore.DecompressionBombError)
    assert issubclass(mmstore.VideoBombError, mmstore.VideoDecodeError)


def test_every_error_is_drawn_in_the_docstring_and_exported():
    doc = _exceptions.__doc__ or ""
    for error in ALL_ERRORS:
        assert error.__name__ in doc, f"{error.__name__} missing from the drawn tree"
        assert error.__name__ in mmstore.__all__
        assert getattr(mmstore, error.__name__) is error
    parents = {mmstore.MmstoreError, mmstore.MediaError, mmstore.TableError}
    assert {e for e, _ in TREE} | parents == set(ALL_ERRORS)


def test_context_is_in_the_message_and_readable_as_attributes():
    err = mmstore.InvalidRolloutError(
        "span overlaps", sample_id="g0-01", image_index=2, run_id="r1", file=None
    )
    assert err.sample_id == "g0-01"
    assert err.image_index == 2
    assert err.run_id == "r1"
    assert err.message == "span overlaps"
    assert err.context == {"sample_id": "g0-01", "image_index": 2, "run_id": "r1"}
    text = str(err)
    assert text.startswith("span overlaps")
    assert "sample_id='g0-01'" in text and "image_index=2" in text and "run_id='r1'" in text
    # None-valued context is dropped, and absent context is an ordinary AttributeError.
    assert "file" not in text
    with pytest.raises(AttributeError):
        _ = err.file
    assert not hasattr(err, "uri")


def test_without_context_the_message_is_plain():
    err = mmstore.MmstoreError("plain")
    assert str(err) == "plain"
    assert err.context == {}


@pytest.mark.parametrize("error", ALL_ERRORS, ids=[e.__name__ for e in ALL_ERRORS])
def test_pickling_keeps_type_message_and_context(error):
    err = error("it broke", file="rollouts/x.parquet", sample_id="s", image_index=0)
    for clone in (pickle.loads(pickle.dumps(err)), copy.copy(err), copy.deepcopy(err)):
        assert type(clone) is error
        assert str(clone) == str(err)
        assert clone.message == "it broke"
        assert clone.context == err.context
        assert clone.image_index == 0


@pytest.mark.parametrize("error", ALL_ERRORS, ids=[e.__name__ for e in ALL_ERRORS])
def test_with_context_keeps_the_type_and_adds_where(error):
    err = error("it broke", uri="media/ab/cd/x.png")
    where = err.with_context(file="rollouts/x.parquet", sample_id="s", image_index=None)
    assert type(where) is error and where is not err
    assert where.message == "it broke"
    assert where.context == {
        "uri": "media/ab/cd/x.png",
        "file": "rollouts/x.parquet",
        "sample_id": "s",
    }
    assert (
        str(where) == "it broke (uri='media/ab/cd/x.png', file='rollouts/x.parquet', sample_id='s')"
    )
    assert where.file == "rollouts/x.parquet"
    # the original is untouched, and the copy still pickles with its context
    assert err.context == {"uri": "media/ab/cd/x.png"} and str(err).endswith("x.png')")
    assert str(pickle.loads(pickle.dumps(where))) == str(where)


def test_with_context_keeps_what_the_raise_site_recorded():
    err = mmstore.InvalidRolloutError("span overlaps", image_index=2, sample_id="inner")
    where = err.with_context(sample_id="outer", image_index=0, run_id="r1")
    assert where.context == {"image_index": 2, "sample_id": "inner", "run_id": "r1"}


def test_with_context_keeps_the_builtin_a_caller_catches():
    err = mmstore.MediaNotFoundError("referenced media is not in the store", uri="u")
    with pytest.raises(FileNotFoundError) as caught:
        raise err.with_context(sample_id="s")
    assert isinstance(caught.value, mmstore.MediaError)
    assert caught.value.sample_id == "s" and caught.value.uri == "u"


class _WithPath(mmstore.CorruptFileError):
    """A subclass with an attribute of its own and a constructor of another shape."""

    def __init__(self, path: str, **context: object) -> None:
        super().__init__(f"cannot read {path}", **context)
        self.path = path


def test_with_context_keeps_a_subclass_and_its_own_attributes():
    err = _WithPath("x.parquet", run_id="r1")
    err.add_note("seen twice")
    where = err.with_context(step=3)
    assert type(where) is _WithPath
    assert where.path == "x.parquet" and where.__notes__ == ["seen twice"]
    assert where.message == "cannot read x.parquet"
    assert where.context == {"run_id": "r1", "step": 3}
    assert isinstance(where, ValueError)


def test_only_a_network_error_is_retryable():
    # A caller's retry loop reads err.retryable: the way to the data failed, not the data.
    assert mmstore.NetworkError("timed out", location="s3://b/k").retryable is True
    assert isinstance(mmstore.NetworkError("x"), OSError)
    assert [e.__name__ for e in ALL_ERRORS if e.retryable] == ["NetworkError"]
    assert issubclass(mmstore.MediaPermissionError, mmstore.MediaError)


@pytest.mark.parametrize("error", ALL_ERRORS, ids=[e.__name__ for e in ALL_ERRORS])
def test_errors_print_under_their_public_name(error):
    # A traceback names the class by its module: mmstore.X, the name a user can catch.
    assert error.__module__ == "mmstore"
    line = traceback.format_exception_only(error("boom"))[-1]
    assert line.startswith(f"mmstore.{error.__name__}: boom")


def test_a_users_own_subclass_keeps_its_module():
    assert _WithPath.__module__ == __name__
    assert type(pickle.loads(pickle.dumps(_WithPath("x.parquet")))) is _WithPath


@pytest.fixture
def one_run(tmp_path) -> mmstore.Store:
    store = mmstore.Store.open(str(tmp_path / "store"), create=True)
    with store.writer(run_id="r1", step=0) as w:
        w.write(mmstore.Rollout(sample_id="a", tokens=[1, 2], prompt_len=1, loss_mask=[0, 1]))
    return store


def test_a_typod_run_and_a_step_not_committed_yet_are_told_apart(one_run):
    with pytest.raises(mmstore.RunNotFoundError) as typo:
        one_run.rollouts(run_id="r2")
    with pytest.raises(mmstore.StepNotCommittedError) as later:
        one_run.rollouts(run_id="r1", step=1)
    assert typo.value.missing_runs == ["r2"] and "r1 (step 0)" in str(typo.value)
    assert not isinstance(later.value, mmstore.RunNotFoundError)
    assert not isinstance(typo.value, mmstore.StepNotCommittedError)
    for err in (typo.value, later.value):  # both stay what callers already catch
        assert isinstance(err, mmstore.NoMatchError)
        assert type(pickle.loads(pickle.dumps(err))) is type(err)


def test_a_media_ref_passed_as_images_says_to_expand_it(one_run):
    media = one_run.put_image(Image.new("RGB", (28, 28)))
    with pytest.raises(mmstore.InvalidRolloutError, match=r"MediaRef.*adapter\.expand\("):
        mmstore.Rollout(sample_id="a", tokens=[1, 2], prompt_len=1, loss_mask=[0, 1],
                        images=[media])  # fmt: skip
