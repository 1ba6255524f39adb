"""The built-in image task (``tasks.shapes``): pictures drawn in code, deterministic per seed,
answers that count what is drawn, records in TRL's vision format read by ``--data builtin:shapes``."""

import numpy as np

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
