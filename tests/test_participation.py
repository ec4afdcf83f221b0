"""Partial participation: who is drawn (the same on every placement), that those sitting out do
nothing and keep their state, and that a gossip round with peers sitting out keeps W_t doubly
stochastic and the peers' average where it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _helpers import run_ranks, toy_dataset

from gossip_pfl.cli import main
from gossip_pfl.config import load_config
from gossip_pfl.errors import GossipError
from gossip_pfl.runtime.participation import participant_count, sample_participants, sit_out
from gossip_pfl.train import Trainer
from topologies import Phase, erdos_renyi, max_degree, metropolis, random_regular, ring

RING = {"graph": "ring", "weights": "metropolis"}


def quiet(*_args, **_kw):
    pass


def cfg_for(out, name="dsgd", rounds=3, participation=1.0, schedule=None, **algo):
    base = {
        "seed": 21,
        "rounds": rounds,
        "algorithm": {"name": name, "lr": 0.3, "batch_size": 16, **algo},
        "participation": participation,
        "schedule": schedule,
        "eval": {"every": rounds},
        "out": str(out),
        "runtime": {"device": "cpu"},
    }
    return load_config(base=base)


def trainer_for(cfg) -> Trainer:
    return Trainer(cfg, dataset=toy_dataset(8), log=quiet)


# ---- 11. The sampler ---------------------------------------------------------------------------

ROUNDS = range(8)


def _draws_and_workers(out):
    """This rank's trainer's draws for ROUNDS, and which of its peers moved in round 0's
    local work: {peer: moved}."""
    trainer = trainer_for(cfg_for(out, participation=3, schedule=RING))
    try:
        draws = [trainer.sample(t) for t in ROUNDS]
        L = len(trainer.peers)
        before = trainer.nodes[:L].clone()
        trainer.local_work(0, draws[0])
        moved = (trainer.nodes[:L] != before).flatten(1).any(1).tolist()
        return draws, {int(p): m for p, m in zip(trainer.peers, moved)}
    finally:
        trainer.comm.close()


def test_sampler_same_on_one_and_four_ranks(tmp_path):
    single, worked = _draws_and_workers(tmp_path / "one")
    for mask in single:
        assert mask.dtype == bool and mask.shape == (8,) and mask.sum() == 3
    assert len({tuple(m) for m in single}) >= len(ROUNDS) - 2  # differs across rounds
    assert [worked[p] for p in range(8)] == single[0].tolist()  # exactly the drawn work
    results = run_ranks(4, _draws_and_workers, tmp_path / "four")
    merged = {}
    for status, value in results:
        assert status == "ok", value
        draws, moved = value
        for a, b in zip(draws, single):
            np.testing.assert_array_equal(a, b)
        merged.update(moved)
    assert [merged[p] for p in range(8)] == single[0].tolist()


def test_sampler_draws_count_distinct_clients_uniformly():
    n, count, rounds = 8, 3, 4000
    masks = np.array([sample_participants(5, t, n, count) for t in range(rounds)])
    assert (masks.sum(1) == count).all()  # exactly count, hence distinct
    # every client equally likely: frequency count / n (binomial sd ~ 0.008 here)
    np.testing.assert_allclose(masks.mean(0), count / n, atol=0.04)
    # a pure function of (seed, round); another seed draws other clients
    np.testing.assert_array_equal(masks[17], sample_participants(5, 17, n, count))
    others = np.array([sample_participants(6, t, n, count) for t in range(50)])
    assert (others != masks[:50]).any()
    assert sample_participants(5, 3, n, n).all()


@pytest.mark.parametrize(
    "participation,want", [(3, 3), (8, 8), (1, 1), (0.5, 4), (1.0, 8), (0.01, 1), (0.3, 2)]
)
def test_participant_count(participation, want):
    assert participant_count(participation, 8) == want


# ---- 12. Sitting out -------------------------------------------------------------------------


def test_fedem_clients_not_sampled_keep_parameters_and_pi(tmp_path):
    """... and their optimizer state (momentum) too."""
    trainer = trainer_for(cfg_for(tmp_path, "fedem", participation=3, components=2,
                                  momentum=0.5))  # fmt: skip
    for t in range(3):
        active = trainer.sample(t)
        theta0 = trainer.nodes[:8].clone()
        pi0 = trainer.personal["pi"].clone()
        mom0 = trainer.opt_state.momentum.clone()
        trainer.local_work(t, active)
        moved = (trainer.nodes[:8] != theta0).flatten(1).any(1).cpu().numpy()
        pi_moved = (trainer.personal["pi"] != pi0).any(1).cpu().numpy()
        mom_moved = (trainer.opt_state.momentum != mom0).flatten(1).any(1).cpu().numpy()
        np.testing.assert_array_equal(moved, active)
        np.testing.assert_array_equal(pi_moved, active)
        np.testing.assert_array_equal(mom_moved, active)
        trainer.communicate(t, active)
    # pi of a client never drawn is still uniform
    drawn = np.any([trainer.sample(t) for t in range(3)], axis=0)
    assert not drawn.all()
    assert (trainer.personal["pi"][~drawn] == 0.5).all()


def test_fedem_e_step_works_out_only_the_participants(tmp_path, monkeypatch):
    """With partial participation the E-step computes the losses of the round's participants
    only (the others' were thrown away), and the rounds give the numbers of an E-step over
    every peer."""
    cfg = cfg_for(tmp_path, "fedem", participation=3, components=2, momentum=0.5)
    cfg.model.name, cfg.model.options = "mlp", {"hidden": [6]}  # not the closed form
    fast, full = trainer_for(cfg), trainer_for(cfg)
    every = full.train_losses  # the reference: every peer's losses, as before
    monkeypatch.setattr(full, "train_losses", lambda theta, split=None, active=None: every(theta))
    seen, losses_of = [], fast.train_losses

    def spy(theta, split=None, active=None):
        seen.append((active, losses_of(theta, split, active)))
        return seen[-1][1]

    monkeypatch.setattr(fast, "train_losses", spy)
    for t in range(3):
        active = fast.sample(t)
        for trainer in (fast, full):
            trainer.local_work(t, active)
            trainer.communicate(t, active)
        asked, losses = seen[-1]
        np.testing.assert_array_equal(asked, active)
        assert (losses[~active] == 0).all() and (losses[active].sum(-1) > 0).all()
        assert fast.participants is None  # (read in begin_round only)
    assert len(seen) == 3
    # (the same numbers; the E-step's calls hold other peers, so allow float rounding)
    torch.testing.assert_close(fast.nodes, full.nodes, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fast.personal["pi"], full.personal["pi"], rtol=1e-6, atol=1e-7)
    fast.local_work(3, None)  # then a round of every peer: every peer's losses
    assert seen[-1][0] is None and (seen[-1][1].sum(-1) > 0).all()


def test_dfedem_sitting_out_peer_unchanged_by_communicate(tmp_path):
    trainer = trainer_for(cfg_for(tmp_path, "dfedem", participation=4, schedule=RING,
                                  components=2))  # fmt: skip
    for t in range(3):
        active = trainer.sample(t)
        start = trainer.nodes.clone()
        trainer.local_work(t, active)
        after_work = trainer.nodes.clone()
        trainer.communicate(t, active)
        assert torch.equal(trainer.nodes[~active], start[~active])  # the whole round
        assert torch.equal(after_work[~active], start[~active])
        # a participant with a participating ring neighbour does mix
        mixed = (trainer.nodes != after_work).flatten(1).any(1).cpu().numpy()
        for i in np.flatnonzero(active):
            assert mixed[i] == (active[(i - 1) % 8] or active[(i + 1) % 8]), (t, i)


# ---- 13. Doubly stochastic W and the conserved average ----------------------------------------


def _zero_diagonal_cycle(n: int) -> np.ndarray:
    """Symmetric doubly stochastic with an empty diagonal: 1/2 to each cycle neighbour."""
    p = np.roll(np.eye(n), 1, axis=1)
    return 0.5 * (p + p.T)


W_CASES = {
    "er_metropolis": lambda: metropolis(erdos_renyi(10, 0.4, seed=3)),
    "regular_max_degree": lambda: max_degree(random_regular(10, 3, seed=4)),
    "ring_metropolis": lambda: metropolis(ring(7)),
    "cycle_zero_diagonal": lambda: _zero_diagonal_cycle(6),
}


@pytest.mark.parametrize("case", list(W_CASES))
def test_sit_out_keeps_symmetric_w_doubly_stochastic(case):
    w = W_CASES[case]()
    n = len(w)
    np.testing.assert_allclose(w, w.T)
    rng = np.random.default_rng(0)
    for _ in range(30):
        active = rng.random(n) < rng.uniform(0.2, 0.9)
        got = sit_out(Phase.from_dense(w), active).dense()
        np.testing.assert_allclose(got.sum(0), 1, atol=1e-12)
        np.testing.assert_allclose(got.sum(1), 1, atol=1e-12)
        np.testing.assert_allclose(got, got.T, atol=1e-15)
        assert (got >= 0).all()
        for i in np.flatnonzero(~active):  # e_i (the moved weights sum to 1 - w_ii)
            np.testing.assert_allclose(got[i], np.eye(n)[i], rtol=0, atol=1e-15)
        # independent construction: drop every link touching an inactive peer, its weight to
        # the diagonal of the row it left
        keep = np.outer(active, active) | np.eye(n, dtype=bool)
        want = np.where(keep, w, 0.0)
        want[np.diag_indices(n)] += (w * ~keep).sum(1)
        np.testing.assert_allclose(got, want, atol=1e-15)
    assert sit_out(Phase.from_dense(w), np.ones(n, dtype=bool)).dense().tolist() == w.tolist()


def test_gossip_round_with_participation_conserves_the_average(tmp_path):
    trainer = trainer_for(cfg_for(tmp_path, "dsgd", participation=5, schedule=RING))
    for t in range(4):
        active = trainer.sample(t)
        assert active.sum() == 5
        trainer.local_work(t, active)
        before = trainer.nodes.double().mean(0)
        spread = trainer.nodes.double().std(0).max()
        trainer.communicate(t, active)
        assert spread > 1e-3  # the peers differ: the round has something to average
        torch.testing.assert_close(trainer.nodes.double().mean(0), before, rtol=0, atol=1e-6)


# ---- 14. Participation needs a symmetric schedule --------------------------------------------


def test_participation_on_non_symmetric_schedule_is_an_error(tmp_path, capsys):
    sched = {"graph": "one_peer_exponential"}
    trainer_for(cfg_for(tmp_path / "full", schedule=sched))  # full participation is fine
    with pytest.raises(GossipError) as err:
        trainer_for(cfg_for(tmp_path / "part", participation=4, schedule=sched))
    msg = str(err.value)
    assert "\n" not in msg and "participation" in msg and "symmetric" in msg, msg
    # and through the command line: one line on stderr, status 2, nothing written
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        "seed: 1\nrounds: 1\n"
        "data: {name: synthetic, n_clients: 8, dim: 5, n_test: 20, cache: false}\n"
        "algorithm: {name: dsgd, batch_size: 16}\nschedule: {graph: one_peer_exponential}\n"
        "participation: 4\nruntime: {device: cpu}\n"
    )
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and "participation" in err_lines[0], err_lines
    assert not out.exists()
