"""LEAF JSON readers and the natural (by-writer) datasets, on tiny hand-written files."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from gossip_pfl.data import leaf, load_dataset
from gossip_pfl.errors import GossipError


def _write(root, split, name, users):
    folder = root / split
    folder.mkdir(parents=True, exist_ok=True)
    content = {
        "users": list(users),
        "num_samples": [len(d["x"]) for d in users.values()],
        "user_data": users,
    }
    (folder / name).write_text(json.dumps(content))


def _femnist(root):
    rng = np.random.default_rng(0)

    def user(n):
        return {"x": rng.random((n, 784)).round(3).tolist(), "y": rng.integers(0, 62, n).tolist()}

    _write(root, "train", "a.json", {"w1": user(6), "w2": user(8)})
    _write(root, "train", "b.json", {"w3": user(5), "w1": user(4)})  # w1 spans two files
    _write(root, "test", "a.json", {"w1": user(2), "w2": user(2), "w3": user(2)})


def test_femnist_natural_partition(tmp_path):
    _femnist(tmp_path)
    data = leaf.load_leaf(tmp_path, "femnist")
    assert data.users == ["w1", "w2", "w3"] and data.train.x.shape == (23, 1, 28, 28)
    ds = load_dataset("femnist", root=tmp_path)
    assert ds.n_clients == 3 and ds.num_classes == 62 and ds.input_shape == (1, 28, 28)
    total = ds.sizes("train") + ds.sizes("val") + ds.sizes("test")
    assert total.tolist() == [12, 10, 7]
    assert ds.meta["users"] == ["w1", "w2", "w3"]


def test_femnist_leaf_split_and_subset(tmp_path):
    _femnist(tmp_path)
    ds = load_dataset("femnist", root=tmp_path, leaf_split=True)
    assert ds.sizes("test").tolist() == [2, 2, 2]
    assert (ds.sizes("train") + ds.sizes("val")).tolist() == [10, 8, 5]
    two = load_dataset("femnist", root=tmp_path, n_clients=2, seed=1)
    assert two.n_clients == 2
    with pytest.raises(GossipError, match="n_clients must be in 1..3"):
        load_dataset("femnist", root=tmp_path, n_clients=4)


def test_shakespeare_encoding_and_min_samples(tmp_path):
    line = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to su"
    assert len(line) == 80
    train = {
        "HAMLET": {"x": [line, line[1:] + "f"], "y": ["f", "e"]},
        "GHOST": {"x": [line], "y": ["!"]},
    }
    _write(tmp_path, "train", "t.json", train)
    _write(tmp_path, "test", "t.json", {"HAMLET": {"x": [line, line, line], "y": ["a", "b", "c"]}})
    ds = load_dataset("shakespeare", root=tmp_path)
    assert ds.n_clients == 1  # GHOST has one sample, under min_samples=2
    # none reaching it was blamed on unseen_fraction ("leaves no client ... out of 0")
    with pytest.raises(
        GossipError,
        match=r"no writer has min_samples = 9 samples \(the most "
        r"any has: 5\)",
    ):
        load_dataset("shakespeare", root=tmp_path, min_samples=9)
    c = ds.clients[0]
    assert c.x_train.dtype == np.int64 and ds.input_shape == (80,) and ds.num_classes == 80
    x = np.concatenate([c.x_train, c.x_val, c.x_test])
    assert leaf.SHAKESPEARE_VOCAB[x[0, 0]] in "Toh"
    assert "".join(leaf.SHAKESPEARE_VOCAB[i] for i in leaf.encode(line)) == line


def test_vocab_and_unknown_character(tmp_path):
    assert len(leaf.SHAKESPEARE_VOCAB) == len(set(leaf.SHAKESPEARE_VOCAB)) == 80
    with pytest.raises(GossipError, match="character '@'"):
        leaf.encode("a@b", "X")


def test_missing_and_bad_files(tmp_path):
    with pytest.raises(GossipError, match=r"no \*\.json files in .*train"):
        leaf.load_leaf(tmp_path, "femnist")
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "x.json").write_text('{"users": []}')
    with pytest.raises(GossipError, match="x.json has no 'user_data'"):
        leaf.load_leaf(tmp_path, "femnist")
    _write(tmp_path, "train", "x.json", {"u": {"x": [[0.0] * 784]}})
    with pytest.raises(GossipError, match="user 'u' lacks"):
        leaf.load_leaf(tmp_path, "femnist")
    with pytest.raises(GossipError, match="only partition.kind 'natural'"):
        load_dataset("femnist", root=tmp_path, partition={"kind": "dirichlet"})


@pytest.mark.parametrize(
    ("kind", "users", "message"),
    [
        # each was a traceback, or ran on a silently changed sample
        ("femnist", {"u": {"x": 5, "y": 5}}, "'x' and 'y' must be lists"),
        ("femnist", {"u": {"x": [{"a": 1}], "y": [1]}}, "not 784-pixel images"),
        ("femnist", {"u": {"x": [[None] * 784], "y": [1]}}, r"pixels that are not numbers"),
        ("femnist", {"u": {"x": [[0.5] * 784], "y": [1.7]}}, "labels that are not whole"),
        ("shakespeare", {"u": {"x": [5], "y": ["a"]}}, "inputs 'x' must be strings"),
        ("shakespeare", {"u": {"x": ["ab"], "y": [""]}}, "'y' must be single characters"),
        ("shakespeare", {"u": {"x": ["ab"], "y": ["cd"]}}, "'y' must be single characters"),
        # 1,568 pixels a sample were cut into two images each, the labels no longer theirs
        (
            "femnist",
            {"u": {"x": [[0.5] * 1568] * 2, "y": [1, 2]}},
            "samples of 1568 pixels, "
            r"expected 784 \(28 x 28\)",
        ),
        ("femnist", {"u": {"x": [[0.5] * 392] * 2, "y": [1, 2]}}, "samples of 392 pixels"),
        ("femnist", {"u": {"x": [[255.0] * 784], "y": [1]}}, r"pixels span 255..255; LEAF's"),
        ("shakespeare", {"u": {"x": [""], "y": ["a"]}}, "input strings are empty"),
        ("femnist", {"u": {"x": [[0.5] * 784], "y": [1e30]}}, r"labels span 1e\+30..1e\+30"),
        # a traceback (OverflowError), and a count of pixels for ten labels of five images
        ("femnist", {"u": {"x": [[0.5] * 784], "y": [10**400]}}, "int too large to convert"),
        ("femnist", {"u": {"x": [[0.5] * 784] * 5, "y": [[1, 2]] * 5}}, "5 samples but 10 labels"),
        # strings and booleans were read as numbers: "7" as 7, "0.5" as 0.5, true as 1
        ("femnist", {"u": {"x": [[0.5] * 784], "y": ["7"]}}, 'label "7" is a JSON string, not a'),
        ("femnist", {"u": {"x": [[0.5] * 784], "y": [True]}}, "label true is a JSON boolean"),
        ("femnist", {"u": {"x": [[0.5] * 783 + ["0.5"]], "y": [1]}}, 'pixel "0.5" is a JSON str'),
        ("femnist", {"u": {"x": [[0.5] * 783 + [True]], "y": [1]}}, "pixel true is a JSON boolean"),
        ("femnist", {"u": {"x": [[False] * 784], "y": [1]}}, "pixel false is a JSON boolean"),
        ("femnist", {"u": {"x": [[None] * 783 + ["1"]], "y": [1]}}, 'pixel "1" is a JSON string'),
        ("femnist", {"u": {"x": [[0.5] * 783 + ["abc"]], "y": [1]}}, 'pixel "abc" is a JSON'),
    ],
)
def test_malformed_leaf_files_are_one_line_errors(tmp_path, kind, users, message):
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        (tmp_path / split / "a.json").write_text(json.dumps({"user_data": users}))
    with pytest.raises(GossipError, match=message) as err:
        leaf.load_leaf(tmp_path, kind)
    if "user 'u'" in str(err.value):  # a user's samples: the file they are in is named too
        assert str(tmp_path / "train" / "a.json") in str(err.value)


def test_a_user_without_samples_in_a_split_is_left_out(tmp_path):
    """(Shakespeare's reshape of no sample was a traceback.)"""
    users = {"u": {"x": ["ab", "cd"], "y": ["c", "e"]}, "v": {"x": [], "y": []}}
    _write(tmp_path, "train", "a.json", users)
    _write(tmp_path, "test", "a.json", {"u": {"x": [], "y": []}, "v": {"x": ["ab"], "y": ["z"]}})
    data = leaf.load_leaf(tmp_path, "shakespeare")
    assert data.train.x.shape == (2, 2) and data.test.x.shape == (1, 2)
    assert data.train.writer.tolist() == [0, 0] and data.test.writer.tolist() == [1]


@pytest.mark.parametrize("kind", ["femnist", "shakespeare"])
def test_writer_fraction_keeps_a_seeded_share_of_the_writers(kind, tmp_path):
    """writer_fraction f of T writers (those with >= min_samples) keeps round(f T) of them,
    each client holding all of its writer's samples (writer k has 2 + k, a fingerprint); the
    same seed keeps the same writers, another seed another set. Checked on 12 writers (one
    more with a single Shakespeare sample, under its min_samples 2) with f T = 3 and 3.6."""
    rng = np.random.default_rng(0)
    line = "To be, or not to be: that is the question. Whether 'tis nobler in the mind to su"
    users = {}
    for k in range(12):
        n = 2 + k
        if kind == "femnist":
            users[f"w{k}"] = {"x": rng.random((n, 784)).round(2).tolist(),
                              "y": rng.integers(0, 62, n).tolist()}  # fmt: skip
        else:
            users[f"w{k}"] = {"x": [line] * n, "y": ["a"] * n}
    if kind == "shakespeare":
        users["lone"] = {"x": [line], "y": ["b"]}  # 1 sample: not among the 12 counted
    _write(tmp_path, "train", "a.json", users)
    _write(tmp_path, "test", "a.json", {"w0": users["w0"]})  # w0: 2 + 2 samples in all
    sizes = {f"w{k}": 2 + k for k in range(12)}
    sizes["w0"] += 2

    def kept(fraction, seed):
        ds = load_dataset(kind, root=tmp_path, writer_fraction=fraction, seed=seed)
        names = ds.meta["users"]
        total = ds.sizes("train") + ds.sizes("val") + ds.sizes("test")
        assert total.tolist() == [sizes[u] for u in names]  # each client is its writer
        return names

    assert len(kept(1.0, 0)) == 12
    for fraction, n in ((0.25, 3), (0.3, 4)):  # round(3.0) = 3, round(3.6) = 4
        a = kept(fraction, 1)
        assert len(a) == len(set(a)) == n and set(a) <= set(sizes)
        assert kept(fraction, 1) == a
        assert set(kept(fraction, 2)) != set(a)


def test_splits_of_other_shapes_and_users_given_twice_are_refused(tmp_path):
    """Shakespeare lines of 80 characters in train and 40 in test ran (with leaf_split) on
    inputs of another length, or ended in a traceback; a user given twice in one file kept
    only the second's samples; a file nested past Python's recursion was a traceback."""
    _write(tmp_path, "train", "a.json", {"u": {"x": ["a" * 80], "y": ["b"]}})
    _write(tmp_path, "test", "a.json", {"u": {"x": ["a" * 40], "y": ["b"]}})
    with pytest.raises(GossipError, match=r"train samples have shape \(80,\) but test ones "
                                          r"\(40,\)"):  # fmt: skip
        leaf.load_leaf(tmp_path, "shakespeare")
    text = '{"user_data": {"u": {"x": ["ab"], "y": ["c"]}, "u": {"x": [], "y": []}}}'
    (tmp_path / "test" / "a.json").write_text(text)
    with pytest.raises(GossipError, match=r"a.json \(key 'u' given twice in one object\)"):
        leaf.load_leaf(tmp_path, "shakespeare")
    (tmp_path / "test" / "a.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(GossipError, match=r"cannot parse .*a.json"):
        leaf.load_leaf(tmp_path, "shakespeare")


def test_odd_shapes_and_empty_splits_name_the_user_file_and_folder(tmp_path):
    """A user whose test lines were 79 characters among others of 80 was "users' samples
    differ in shape: [(79,), (80,)]", and an empty 'user_data' "a split's JSON files hold no
    user": neither said which user, file or folder."""
    line = "a" * 80
    users = {u: {"x": [line] * 3, "y": ["b"] * 3} for u in ("u0", "u1", "u2")}
    _write(tmp_path, "train", "a.json", users)
    _write(tmp_path, "test", "a.json", {"u0": users["u0"], "u2": users["u2"]})
    _write(tmp_path, "test", "b.json", {"u1": {"x": [line[1:]] * 2, "y": ["b"] * 2}})
    with pytest.raises(GossipError) as err:
        leaf.load_leaf(tmp_path, "shakespeare")
    assert str(err.value) == (
        f"shakespeare: user 'u1' has samples of shape (79,) but 2 other user(s) in "
        f"{tmp_path / 'test'} have (80,) (in {tmp_path / 'test' / 'b.json'})"
    )
    _write(tmp_path, "test", "b.json", {})
    (tmp_path / "test" / "a.json").unlink()
    with pytest.raises(GossipError) as err:
        leaf.load_leaf(tmp_path, "shakespeare")
    assert str(err.value) == (
        f"shakespeare: the JSON files in {tmp_path / 'test'} hold no user (empty 'user_data')"
    )
    _write(tmp_path, "test", "b.json", {"u1": {"x": [], "y": []}})
    with pytest.raises(GossipError) as err:
        leaf.load_leaf(tmp_path, "shakespeare")
    assert f"in {tmp_path / 'test'} hold no sample" in str(err.value)


def _shakespeare_writers(root, sizes, test_sizes=None):
    """Shakespeare writers ``w0, w1, ...`` with ``sizes`` train lines (and ``test_sizes`` test
    lines; default: none, and one writer with one to keep the test split non-empty)."""
    line = "a" * 80
    users = {f"w{k}": {"x": [line] * n, "y": ["b"] * n} for k, n in enumerate(sizes)}
    _write(root, "train", "a.json", users)
    test_sizes = test_sizes if test_sizes is not None else [1] + [0] * (len(sizes) - 1)
    tests = {f"w{k}": {"x": [line] * n, "y": ["b"] * n} for k, n in enumerate(test_sizes) if n}
    _write(root, "test", "a.json", tests)


def test_writers_too_small_for_the_split_are_left_out_with_a_warning(tmp_path):
    """Shakespeare's default min_samples 2 kept a writer of 2 samples, which 60/20/20 (3: one
    each) cannot cut: "client 5 has 2 samples, too few for the split (0.6, 0.2, 0.2); use fewer
    clients, a larger alpha, ..." named no writer and the wrong option. Such writers are now
    left out (said in a warning and in meta), as those under min_samples are (silently)."""
    _shakespeare_writers(tmp_path, [4, 3, 2, 1, 5])  # w0: 4 + 1 test; w3: 1, under min_samples
    with pytest.warns(UserWarning) as said:
        ds = load_dataset("shakespeare", root=tmp_path)
    assert [str(w.message) for w in said] == [
        "shakespeare: 1 of 5 writers left out: 1 with too few samples for the split (0.6, 0.2, "
        "0.2), which takes at least 3; data.min_samples: 3 leaves such writers out without "
        "this warning"
    ]
    assert ds.meta["users"] == ["w0", "w1", "w4"]
    assert ds.meta["writers_left_out"] == {"min_samples": 1, "too_few_for_split": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the left out under min_samples are not said
        ds = load_dataset("shakespeare", root=tmp_path, min_samples=3)
        assert ds.meta["users"] == ["w0", "w1", "w4"]
        ds = load_dataset("shakespeare", root=tmp_path, split=[1.0, 0.0, 0.0])  # takes 1
        assert ds.meta["users"] == ["w0", "w1", "w2", "w4"]
    # FEMNIST's default min_samples is 1: writers of 1 and 2 samples were errors
    rng = np.random.default_rng(0)
    users = {f"w{k}": {"x": rng.random((n, 784)).round(2).tolist(), "y": [1] * n}
             for k, n in enumerate([2, 1, 2, 4])}  # fmt: skip
    _write(tmp_path / "f", "train", "a.json", users)
    _write(tmp_path / "f", "test", "a.json", {"w0": {"x": [[0.5] * 784], "y": [2]}})
    with pytest.warns(UserWarning, match="femnist: 2 of 4 writers left out: 2 with too few"):
        ds = load_dataset("femnist", root=tmp_path / "f")
    assert ds.meta["users"] == ["w0", "w3"] and ds.sizes("test").tolist() == [1, 1]
    # with leaf_split, the train samples are cut 80/20 into train / val: that takes 2
    _shakespeare_writers(tmp_path / "l", [2, 1, 3], test_sizes=[1, 1, 1])
    with pytest.warns(UserWarning) as said:
        ds = load_dataset("shakespeare", root=tmp_path / "l", leaf_split=True, min_samples=1)
    assert ds.meta["users"] == ["w0", "w2"]
    # (no min_samples hint: it counts test samples too, and w1 has 1 + 1 of them)
    assert [str(w.message) for w in said] == [
        "shakespeare: 1 of 3 writers left out: 1 with too few train samples for the split "
        "(0.8, 0.2, 0.0), which takes at least 2"
    ]


def test_writers_left_out_are_named_when_too_few_remain(tmp_path):
    _shakespeare_writers(tmp_path, [4, 2, 2])
    with pytest.warns(UserWarning), pytest.raises(GossipError) as err:
        load_dataset("shakespeare", root=tmp_path, n_clients=2)
    assert str(err.value) == (
        "shakespeare: n_clients must be in 1..1 (writers available), got 2; left out: 2 with "
        "too few samples for the split (0.6, 0.2, 0.2), which takes at least 3"
    )
    _shakespeare_writers(tmp_path / "s", [1, 1, 1])  # (w0 has 1 more, in test)
    with pytest.raises(GossipError) as err:
        load_dataset("shakespeare", root=tmp_path / "s")
    assert str(err.value) == (
        "shakespeare: all 3 writers are left out: 1 with too few samples for the split (0.6, "
        "0.2, 0.2), which takes at least 3; 2 with fewer than min_samples = 2"
    )


def test_leaf_split_leaves_out_writers_missing_from_a_split(tmp_path):
    """With leaf_split, a writer with train samples but none in LEAF's test files was "by_writer
    partition leaves client 2 of 5 with no samples; drop writers without samples": no writer,
    no split, and an option that does not exist. It is now left out (said in a warning); too
    few writers left for n_clients, or none (LEAF's '-t user' files), is an error saying so."""
    _shakespeare_writers(tmp_path, [4, 4, 4, 0], test_sizes=[1, 0, 2, 3])
    with pytest.warns(UserWarning) as said:
        ds = load_dataset("shakespeare", root=tmp_path, leaf_split=True)
    assert [str(w.message) for w in said] == [
        f"shakespeare: 2 of 4 writers left out: 1 with no sample in LEAF's train split "
        f"({tmp_path / 'train'}); 1 with no sample in LEAF's test split ({tmp_path / 'test'})"
    ]
    assert ds.meta["users"] == ["w0", "w2"] and ds.sizes("test").tolist() == [1, 2]
    assert ds.meta["writers_left_out"] == {
        "min_samples": 0,
        "no_train_samples": 1,
        "no_test_samples": 1,
        "too_few_for_split": 0,
    }
    with pytest.warns(UserWarning), pytest.raises(GossipError) as err:
        load_dataset("shakespeare", root=tmp_path, leaf_split=True, n_clients=3)
    assert str(err.value).startswith(
        "shakespeare: n_clients must be in 1..2 (writers available), got 3; left out: 1 with "
        f"no sample in LEAF's train split ({tmp_path / 'train'}); 1 with no sample in LEAF's "
        f"test split ({tmp_path / 'test'})"
    )
    with warnings.catch_warnings():  # (pooled, every writer is a client)
        warnings.simplefilter("error")
        assert load_dataset("shakespeare", root=tmp_path).n_clients == 4
    _shakespeare_writers(tmp_path / "u", [4, 4, 0], test_sizes=[0, 0, 3])  # LEAF's -t user
    with pytest.raises(GossipError) as err:
        load_dataset("shakespeare", root=tmp_path / "u", leaf_split=True)
    assert str(err.value) == (
        f"shakespeare: all 3 writers are left out: 1 with no sample in LEAF's train split "
        f"({tmp_path / 'u' / 'train'}); 2 with no sample in LEAF's test split "
        f"({tmp_path / 'u' / 'test'}); data.leaf_split needs writers with samples in both "
        "splits (LEAF's '-t sample'; '-t user' puts each writer in one alone): set it to false"
    )


@pytest.mark.parametrize(
    "option", [{"n_clients": 3}, {"writer_fraction": 0.5}, {"writer_fraction": 0.5, "n_clients": 2}]
)
def test_a_seed_picks_the_writers_it_picked_before_small_ones_were_left_out(tmp_path, option):
    """The seeded choice draws among the writers with min_samples, then keeps those the split
    can cut: where no small writer was chosen (the run was refused otherwise), the same writers
    as before (drawing among the kept ones changed the pick, and every such run's numbers)."""
    _shakespeare_writers(tmp_path, [4, 5, 2, 4, 5, 4, 6])  # w2: 2 samples, too few for 60/20/20
    for seed in range(12):
        rng = np.random.default_rng([seed, 0x1EAF])  # the choice as it was made:
        before = np.arange(7)  # (all have min_samples = 2)
        if "writer_fraction" in option:
            before = rng.permutation(before)[: round(0.5 * 7)]
        if "n_clients" in option:
            before = rng.permutation(before)[: option["n_clients"]]
        before, k = sorted(before), len(before)
        with pytest.warns(UserWarning, match="1 with too few samples"):
            ds = load_dataset("shakespeare", root=tmp_path, seed=seed, **option)
        if 2 not in before:
            assert ds.meta["users"] == [f"w{w}" for w in before], seed
        else:  # (refused before): the next writer drawn stands in
            assert "w2" not in ds.meta["users"] and len(ds.meta["users"]) == k, seed
