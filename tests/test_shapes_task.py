"""The built-in image task (``tasks.shapes``): pictures drawn in code, deterministic per seed,
answers that count what is drawn, records in TRL's vision format read by ``--data builtin:shapes``."""

import numpy as np
import pytest

from nnx_posttrain import data
from nnx_posttrain.tasks import shapes


def _cells(image, colour):
    """How many quarters of the picture hold a shape of ``colour`` (one shape a quarter)."""
    half = shapes.SIZE // 2
    rgb = np.array(shapes.COLOURS[colour], np.uint8)
    return sum(bool(np.all(image[r:r + half, c:c + half] == rgb, axis=-1).any())
               for r in (0, half) for c in (0, half))


def test_pictures_are_deterministic_per_seed():
    a, b = shapes.problem(7, seed=3), shapes.problem(7, seed=3)
    np.testing.assert_array_equal(a[0], b[0])
    assert a[1:] == b[1:]
    assert not all(np.array_equal(shapes.problem(i, 3)[0], shapes.problem(i, 4)[0]) for i in range(5))
    assert not np.array_equal(shapes.problem(0)[0], shapes.problem(1)[0])


def test_a_sample_counts_what_is_drawn():
    for index in range(50):
        image, colour, count = shapes.problem(index)
        assert image.shape == (32, 32, 3) and image.dtype == np.uint8
        assert 0 <= count <= shapes.MAX_SHAPES and _cells(image, colour) == count
        assert (image != shapes.BACKGROUND).any()
    record = shapes.sft_record(5)
    assert record["messages"][0]["content"][0] == {"type": "image"}
    assert record["messages"][1]["content"] == str(shapes.problem(5)[2])
    assert shapes.prompt_record(5)["answer"] == record["messages"][1]["content"]
    pair = shapes.preference_record(5)
    assert pair["chosen"] != pair["rejected"] and pair["images"][0].shape == (32, 32, 3)


def test_builtin_shapes_is_a_data_source():
    src = data.source("builtin:shapes", "eval", builtin="prompt_only")
    assert len(src) == shapes.SIZES["eval"] and src[0]["_where"] == "builtin:shapes:prompt_only:eval[0]"
    assert data.signature("builtin:shapes")[0][0] == "builtin:shapes"
    assert data.builtin_fingerprint("builtin:shapes") != data.builtin_fingerprint()


@pytest.mark.slow
def test_the_sloppy_teacher_confuses_blue_with_green_on_a_defined_share(monkeypatch):
    """The teacher's mistake, on a fixed sample of 2,000 training problems: wrong only where the
    question asks for green shapes and the picture holds a blue one (about 20% of the problems),
    there answering green + blue (as counted on the picture), ``SLIP_RATE`` of the time."""
    assert shapes.CONFUSED == ("green", "blue") and shapes.SLIP_RATE == 0.8
    confused = slipped = 0
    for index in range(2000):
        image, colour, count = shapes.problem(index)
        answer = int(shapes.demonstration(index))
        is_confused = colour == "green" and _cells(image, "blue") > 0
        assert shapes.confused(index) == is_confused
        if not is_confused:
            assert answer == count and not shapes.slips(index)
            continue
        confused += 1
        both = _cells(image, "green") + _cells(image, "blue")
        assert answer in (count, both) and both > count
        assert (answer == both) == shapes.slips(index)
        slipped += answer == both
    assert 0.17 < confused / 2000 < 0.23  # 19.5% of this sample
    assert 0.75 < slipped / confused < 0.85  # 82.3%: SLIP_RATE of them, drawn per problem
    # the training split's SFT records are the teacher's, every other record the checker's
    monkeypatch.setitem(shapes.SIZES, "train", 60)
    monkeypatch.setitem(shapes.SIZES, "eval", 60)
    taught = shapes.records("sft", "train")
    assert [r["messages"][1]["content"] for r in taught] == [shapes.demonstration(i)
                                                             for i in range(60)]
    slips = [i for i in range(60) if shapes.slips(i)]
    assert slips and all(taught[i]["messages"][1]["content"] != str(shapes.problem(i)[2])
                         for i in slips)
    for kind, answer in (("sft", lambda r: r["messages"][1]["content"]),
                         ("prompt_only", lambda r: r["answer"]),
                         ("preference", lambda r: r["chosen"][0]["content"])):
        held_out = shapes.records(kind, "eval")
        assert [answer(r) for r in held_out] == [str(shapes.problem(i)[2])
                                                for i in shapes.indices("eval")]
    pair = shapes.preference_record(slips[0])  # rejected: the teacher's slip
    assert pair["rejected"][0]["content"] == shapes.demonstration(slips[0])
