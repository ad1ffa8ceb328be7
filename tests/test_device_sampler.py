"""The device sampler against the per-row reference sampler, and both against the rules
written out by hand (top-p's smallest set, min-p's threshold, each penalty's formula)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.device_sampler import (
    SampleFlags,
    SamplingBuffers,
    penalized,
    sample_on_device,
)
from pdserve.engine.sampler import SampleRow, sample
from pdserve.engine.sampling_noise import exponential_noise
from pdserve.protocol import SamplingParams

VOCAB = 300
EOS = (2,)
LOGPROB_TOL = 1e-5  # float32 log_softmax of the same logits, batched vs one row


def _device_sample(logits: torch.Tensor, rows: list[SampleRow], padded: int | None = None):
    bufs = SamplingBuffers(8, logits.shape[1], logits.device)
    padded = padded or len(rows)
    flags = bufs.fill(rows, padded)
    full = torch.cat([logits, torch.zeros(padded - len(rows), logits.shape[1])])
    return bufs.fetch(sample_on_device(full, bufs, flags), rows)


def _rows(params: list[SamplingParams], seed: int = 0) -> list[SampleRow]:
    g = torch.Generator().manual_seed(seed)
    return [SampleRow(p, torch.randint(0, VOCAB, (7,), generator=g).tolist(),
                      torch.randint(0, VOCAB, (i + 1,), generator=g).tolist(), EOS)
            for i, p in enumerate(params)]


CASES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.7, seed=11),
    "top_k": dict(temperature=1.0, top_k=5, seed=12),
    "top_k_1": dict(temperature=1.0, top_k=1),
    "top_p": dict(temperature=1.3, top_p=0.6, seed=13),
    "min_p": dict(temperature=1.0, min_p=0.2, seed=14),
    "all_filters": dict(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, seed=15),
    "min_p_top_k": dict(temperature=0.7, top_k=20, min_p=0.1, seed=18),
    "min_p_top_p": dict(temperature=1.2, top_p=0.8, min_p=0.15, seed=19),
    "repetition": dict(temperature=0.0, repetition_penalty=1.8),
    "presence_frequency": dict(temperature=0.8, presence_penalty=1.5, frequency_penalty=0.7,
                               seed=16),
    "min_tokens": dict(temperature=0.0, min_tokens=5, stop_token_ids=[7]),
    "logprobs": dict(temperature=0.6, seed=17, logprobs=5),
    "logprobs_0": dict(temperature=0.0, logprobs=0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_device_sampler_equals_reference(name):
    torch.manual_seed(0)
    params = [SamplingParams(**CASES[name]), SamplingParams(temperature=0.0),
              SamplingParams(**{**CASES[name], "seed": 99} if "seed" in CASES[name]
                             else CASES[name])]
    rows = _rows(params)
    for trial in range(5):
        logits = torch.randn(len(rows), VOCAB) * 3
        if name == "min_tokens":  # make EOS and the stop id the favourites
            logits[:, EOS[0]] += 50
            logits[:, 7] += 40
        ref = sample(logits.clone(), rows)
        dev = _device_sample(logits, rows, padded=4)
        assert [t for t, _ in dev] == [t for t, _ in ref], (name, trial)
        for (_, a), (_, b) in zip(dev, ref):
            assert (a is None) == (b is None)
            if a is not None:
                assert math.isclose(a.logprob, b.logprob, abs_tol=LOGPROB_TOL)
                assert [i for i, _ in a.top] == [i for i, _ in b.top]
                assert all(math.isclose(x, y, abs_tol=LOGPROB_TOL)
                           for (_, x), (_, y) in zip(a.top, b.top))
    if name == "min_tokens":
        assert dev[0][0] not in (EOS[0], 7) and dev[1][0] == EOS[0]


def test_rows_all_sampled_take_no_argmax(monkeypatch):
    """With no greedy row the argmax is skipped (flags.greedy False): the draws alone are
    the tokens, the reference's, padded rows and all."""
    import pdserve.engine.device_sampler as ds

    rows = _rows([SamplingParams(temperature=0.9, seed=21),
                  SamplingParams(temperature=1.1, seed=23),
                  SamplingParams(temperature=0.7, top_k=9, seed=22)])
    one_greedy = rows[:1] + _rows([SamplingParams(temperature=0.0)])
    assert not SampleFlags.of(rows, VOCAB).greedy and SampleFlags.of(one_greedy, VOCAB).greedy
    calls = []
    monkeypatch.setattr(ds, "greedy_tokens", lambda x: calls.append(x) or x.argmax(-1))
    torch.manual_seed(4)
    for _ in range(5):
        logits = torch.randn(len(rows), VOCAB) * 3
        ref = sample(logits.clone(), rows)
        assert [t for t, _ in _device_sample(logits, rows, padded=4)] == [t for t, _ in ref]
    assert not calls


def test_seeded_rows_ignore_batch_company():
    torch.manual_seed(1)
    logits = torch.randn(1, VOCAB)
    alone = SamplingParams(temperature=1.0, seed=5)
    row = _rows([alone])[0]
    solo = _device_sample(logits, [row])[0][0]
    others = _rows([SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)], seed=3)
    batch = torch.cat([torch.randn(2, VOCAB), logits])
    assert _device_sample(batch, [*others, row], padded=8)[2][0] == solo


def test_noise_is_exponential_and_keyed():
    n = exponential_noise(torch.tensor([3, 3, 4]), torch.tensor([0, 1, 0]), 20000)
    assert n.min() > 0
    assert abs(float(n.mean()) - 1.0) < 0.03 and abs(float(n.var()) - 1.0) < 0.08
    assert not torch.equal(n[0], n[1]) and not torch.equal(n[0], n[2])
    again = exponential_noise(torch.tensor([4]), torch.tensor([0]), 20000)
    assert torch.equal(again[0], n[2])


def _kept(logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """Tokens the sampler can return: the support over many draws with different seeds."""
    rows = [SampleRow(SamplingParams(**{**params.__dict__, "seed": s}), [], [], EOS)
            for s in range(200)]
    out = _device_sample_many(logits, rows)
    return set(out)


def _device_sample_many(logits: torch.Tensor, rows: list[SampleRow]) -> list[int]:
    bufs = SamplingBuffers(len(rows), logits.shape[-1], logits.device)
    flags = bufs.fill(rows, len(rows))
    packed = sample_on_device(logits.expand(len(rows), -1).contiguous(), bufs, flags)
    return [t for t, _ in bufs.fetch(packed, rows)]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()
    # by hand: sorted 0.4, 0.3 (0.7 < 0.75), + 0.15 reaches 0.85 >= 0.75 -> {1, 2, 3}
    assert _kept(logits, SamplingParams(top_p=0.75)) == {1, 2, 3}
    assert _kept(logits, SamplingParams(top_p=0.7)) == {1, 2}  # 0.7 reached exactly
    assert _kept(logits, SamplingParams(top_p=0.3)) == {1}


def test_top_k_and_min_p_thresholds():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()
    assert _kept(logits, SamplingParams(top_k=2)) == {1, 2}
    # min-p keeps p >= min_p * max_p: 0.3 * 0.4 = 0.12 -> {0.4, 0.3, 0.15}
    assert _kept(logits, SamplingParams(min_p=0.3)) == {1, 2, 3}
    assert _kept(logits, SamplingParams(min_p=0.74)) == {1, 2}  # 0.296 <= 0.3


def test_min_p_filter_is_the_probability_rule():
    """min_p_filter's y - max < log(min_p) keeps what probs < min_p * max(probs) keeps,
    wherever a token's probability is not within rounding of the cut (rows of -inf too);
    a min-p of 0 (threshold -inf) keeps everything."""
    from pdserve.engine.sampler import min_p_filter, min_p_threshold

    g = torch.Generator().manual_seed(6)
    y = torch.randn(40, 5000, generator=g) * torch.linspace(0.3, 8.0, 40)[:, None]
    y[::5, :1000] = float("-inf")
    min_p = torch.rand(40, generator=g) * 0.5
    min_p[3] = 1.0
    thr = torch.tensor([min_p_threshold(m) for m in min_p.tolist()])
    got = min_p_filter(y, thr).isinf()
    probs = y.double().softmax(-1)
    ratio = probs / probs.amax(-1, keepdim=True)
    want = ratio < min_p.double()[:, None]
    edge = (ratio / min_p.double()[:, None] - 1).abs() < 1e-5
    assert torch.equal(got[~edge], want[~edge]) and edge.sum() < 5
    assert not min_p_filter(y, torch.full((40,), float("-inf"))).isinf()[y > -1e30].any()
    assert min_p_threshold(0.0) == float("-inf") and min_p_threshold(1.0) == 0.0


def test_penalty_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25,
                       temperature=0.0)
    # seen (prompt + output) = {0, 1, 3}; output counts: 3 twice, 1 once
    row = SampleRow(p, [0, 1], [3, 1, 3], EOS)
    bufs = SamplingBuffers(1, 6, torch.device("cpu"))
    flags = bufs.fill([row], 1)
    got = penalized(logits, bufs, flags)[0].tolist()
    want = [2.0 / 2,  # seen, positive: divided
            -1.0 * 2 - (0.25 * 1 + 0.5),  # seen, negative: multiplied; once in output
            0.5,
            3.0 / 2 - (0.25 * 2 + 0.5),  # seen; twice in output
            -2.0, 1.0]
    assert got == pytest.approx(want, abs=1e-6)
    # the reference sampler's numbers, by the same formula
    from pdserve.engine.sampler import _apply_penalties

    assert _apply_penalties(logits[0].clone(), row).tolist() == pytest.approx(want, abs=1e-6)


def test_flags_reflect_rows_and_all_runs_everything():
    rows = _rows([SamplingParams(temperature=0.0)])
    assert SampleFlags.of(rows, VOCAB) == SampleFlags()
    logits = torch.randn(1, VOCAB)
    bufs = SamplingBuffers(2, VOCAB, torch.device("cpu"))
    bufs.ensure_dense()
    bufs.fill(rows, 2)
    everything = sample_on_device(torch.cat([logits, logits]), bufs, SampleFlags.ALL)
    assert int(everything[0, 0]) == int(logits.argmax())  # every stage a no-op for greedy


def _full_sort_filter(y, top_k, top_p, monkeypatch):
    import pdserve.engine.device_sampler as ds

    with monkeypatch.context() as m:
        m.setattr(ds, "TOP_CANDIDATES", ())
        return ds._top_k_top_p(y, top_k, top_p)


@pytest.mark.parametrize("level", [0, 1])
def test_top_k_top_p_from_candidates_equals_the_full_sort(monkeypatch, level):
    """The candidate path (a vocabulary past twice the candidates) keeps what the full sort
    keeps, row by row: top-k alone, top-p alone (peaked rows: the mass closes early), both,
    and neither beside them in one batch."""
    from pdserve.engine.device_sampler import (
        TOP_CANDIDATES,
        _top_k_top_p,
        _top_k_top_p_candidates,
    )

    n = TOP_CANDIDATES[level]
    v = 4 * n + 37
    g = torch.Generator().manual_seed(3)
    y = torch.randn(6, v, generator=g) * 4
    y[3, 100] = float("-inf")  # a banned token stays banned
    top_k = torch.tensor([5, v, 40, v, n, v])
    top_p = torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 1.0])
    got, done = _top_k_top_p_candidates(y, top_k, top_p, n)
    assert done.all()  # every row is taken at this level
    want = _full_sort_filter(y, top_k, top_p, monkeypatch)
    assert torch.equal(_top_k_top_p(y, top_k, top_p).isinf(), want.isinf())
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], want[~want.isinf()])
    assert (~got[5].isinf()).all() and (~got[0].isinf()).sum() == 5


def test_top_p_past_the_candidates_falls_back_to_the_sort(monkeypatch):
    from pdserve.engine.device_sampler import (
        TOP_CANDIDATES,
        _top_k_top_p,
        _top_k_top_p_candidates,
    )

    n = TOP_CANDIDATES[-1]
    v = 4 * n
    y = torch.zeros(2, v)  # flat: top-p 0.9 keeps ~90 % of the vocabulary
    y[1] = torch.randn(v, generator=torch.Generator().manual_seed(4)) * 0.01
    top_k, top_p = torch.tensor([v, v]), torch.tensor([0.9, 0.9])
    assert not any(_top_k_top_p_candidates(y, top_k, top_p, c)[1].any()
                   for c in TOP_CANDIDATES)
    mid_k = torch.tensor([n + 1, 7])  # a top-k past the candidates; one within them
    assert _top_k_top_p_candidates(y, mid_k, torch.tensor([1.0, 1.0]), n)[1].tolist() == [
        False, True]
    got = _top_k_top_p(y[1:], top_k[1:], top_p[1:])
    assert torch.equal(got, _full_sort_filter(y[1:], top_k[1:], top_p[1:], monkeypatch))
    assert 0.85 * v < int((~got.isinf()).sum()) < 0.95 * v


def test_a_batch_mixing_the_levels_equals_the_full_sort(monkeypatch):
    """Rows taken from 512 candidates, from 4,096, and from the sort, in one batch."""
    from pdserve.engine.device_sampler import _top_k_top_p, _top_k_top_p_candidates

    v = 16384
    g = torch.Generator().manual_seed(5)
    y = torch.cat([torch.randn(1, v, generator=g) * s for s in (6.0, 2.5, 0.5)])
    top_k, top_p = torch.full((3,), v), torch.full((3,), 0.9)
    assert _top_k_top_p_candidates(y, top_k, top_p, 512)[1].tolist() == [True, False, False]
    assert _top_k_top_p_candidates(y, top_k, top_p, 4096)[1].tolist() == [True, True, False]
    got = _top_k_top_p(y, top_k, top_p)
    assert torch.equal(got, _full_sort_filter(y, top_k, top_p, monkeypatch))


def test_touched_pairs_equal_the_dense_formula():
    """The CPU's penalties and bans on the (row, token) pairs they touch against the dense
    [rows, vocab] tensors a captured graph uses: the same logits, row by row, over steps that
    switch the penalties on and off (a dense row left from an earlier step must not leak)."""
    from pdserve.engine.device_sampler import penalized

    params = [SamplingParams(repetition_penalty=1.3, temperature=0.0),
              SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4, temperature=0.7,
                             seed=1),
              SamplingParams(temperature=0.0),
              SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, min_tokens=50,
                             stop_token_ids=[3], temperature=0.0)]
    steps = [_rows(params), _rows([SamplingParams(temperature=0.0)] * 2), _rows(params[1:], 1)]
    touched = SamplingBuffers(4, VOCAB, torch.device("cpu"))
    dense = SamplingBuffers(4, VOCAB, torch.device("cpu"), sparse=False)
    assert touched.sparse and not dense.sparse
    for rows in steps:
        logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(3)) * 3
        got = penalized(logits, touched, touched.fill(rows, len(rows)))
        want = penalized(logits, dense, dense.fill(rows, len(rows)))
        assert torch.equal(got, want)
        assert torch.equal(logits, torch.randn(len(rows), VOCAB, generator=torch.Generator()
                                               .manual_seed(3)) * 3)  # not changed in place
    logits = torch.randn(4, VOCAB)
    assert not torch.equal(penalized(logits, touched, touched.fill(steps[0], 4)), logits)


def _engine_rows(seqs) -> list[SampleRow]:
    """A step's rows as ModelRunner._rows builds them: each request's own lists."""
    return [SampleRow(s.params, s.prompt_token_ids, s.output_token_ids, EOS) for s in seqs]


def test_penalty_tables_over_steps_equal_the_dense_formula():
    """The CPU's per-request tables, carried from step to step, give the dense formula's
    logits bit for bit (and `sample_on_device` its packed result, the logits it penalises
    in place put back) while requests join, leave, are preempted and come back, a request
    id is reused, the batch is reordered, steps have no penalised row at all, and an output
    changes other than by appending; a request whose output only grew keeps its table."""
    from pdserve.engine.sequence import Sequence

    g = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(0, VOCAB, (n,), generator=g).tolist()

    kinds = [
        SamplingParams(repetition_penalty=1.3, temperature=0.0),
        SamplingParams(presence_penalty=0.5, frequency_penalty=-0.4, temperature=0.7, seed=1),
        SamplingParams(repetition_penalty=0.9, presence_penalty=1.1, frequency_penalty=0.6,
                       temperature=1.0, top_p=0.9, seed=2, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(repetition_penalty=0.8, min_tokens=6, stop_token_ids=[3],
                       temperature=0.0),
        # migrated: its last 4 prompt tokens are output made elsewhere (counted)
        SamplingParams(presence_penalty=-1.0, frequency_penalty=0.4, output_offset=4,
                       temperature=0.0),
    ]
    made = 0

    def new(kind: int) -> Sequence:
        nonlocal made
        made += 1
        prompt = toks(5 + made % 7) + ([VOCAB + 5] if made % 3 == 0 else [])  # >= vocab
        return Sequence(f"r{made}", prompt, kinds[kind], output_token_ids=toks(made % 4))

    def penalised(s: Sequence) -> bool:
        p = s.params
        return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)

    touched = SamplingBuffers(16, VOCAB, torch.device("cpu"))
    dense = SamplingBuffers(16, VOCAB, torch.device("cpu"), sparse=False)
    live = [new(k) for k in range(6)]
    preempted: list[Sequence] = []
    changed: set[int] = set()  # outputs changed other than by appending
    kept_tables = 0
    for step in range(18):
        if step == 3:  # joins
            live += [new(k) for k in (0, 1, 2, 5)]
        if step == 5:  # preempted: out of the batch, then back with the same output
            preempted = [live.pop(1), live.pop(2)]
        if step == 6:  # finishes; a new request takes its id
            gone = live.pop(0)
            live.append(Sequence(gone.request_id, list(gone.prompt_token_ids), gone.params))
        if step == 8:
            live += preempted
        if step == 12:  # last step's last read token rewritten; an output shortened
            a, b = [s for s in live if penalised(s) and len(s.output_token_ids) > 2][:2]
            a.output_token_ids[-2] = (a.output_token_ids[-2] + 1) % VOCAB
            del b.output_token_ids[-2:]
            changed = {id(a.output_token_ids), id(b.output_token_ids)}
        batch = live if step not in (9, 10) else [s for s in live if not penalised(s)]
        batch = [batch[i] for i in torch.randperm(len(batch), generator=g).tolist()]
        before = dict(touched.tables._tables)  # noqa: SLF001 - the state under test
        rows = _engine_rows(batch)
        n = len(rows)
        logits = torch.randn(n, VOCAB, generator=g) * 3
        raw = logits.clone()
        tf, df = touched.fill(rows, n), dense.fill(rows, n)
        assert tf == df
        want = penalized(logits, dense, df)
        assert torch.equal(penalized(logits, touched, tf), want), step
        packed = sample_on_device(logits, touched, tf)
        assert torch.equal(logits, raw)  # penalised in place, put back
        assert torch.equal(packed, sample_on_device(logits, dense, df)), step
        tables = touched.tables._tables  # noqa: SLF001
        assert set(tables) == {id(s.output_token_ids) for s in batch if penalised(s)}
        for s in batch:
            key = id(s.output_token_ids)
            if key in before and key in tables:
                assert (tables[key] is before[key]) == (key not in changed), step
                kept_tables += key not in changed
        changed = set()
        for s in batch:  # the step's tokens
            s.output_token_ids.append(int(packed[batch.index(s), 0]))
    assert kept_tables > 40  # most steps read only the new token


def test_penalty_tables_leave_with_their_requests(tiny_model_dir):
    """Through the engine, 40 penalised requests in turn, some aborted, some preempted by a
    small pool: after every step the sampler holds tables only for the requests that step
    sampled, and none once a step samples no penalised request."""
    from conftest import tiny_engine

    eng = tiny_engine(tiny_model_dir, max_num_seqs=6, num_kv_blocks=8)
    tables = eng.runner.sampling.tables
    eng.trace = []
    seqs, submitted, aborted, most = {}, 0, 0, 0
    while submitted < 40 or eng.has_unfinished():
        while submitted < 40 and len(eng.seqs) < 8:
            p = SamplingParams(max_tokens=4 + submitted % 9, ignore_eos=True,
                               temperature=0.0 if submitted % 2 else 0.8, seed=submitted,
                               repetition_penalty=1.2,
                               frequency_penalty=0.3 if submitted % 3 else 0.0)
            rid = f"p{submitted}"
            seqs[rid] = eng.add_request(rid, [(7 * submitted + j) % 900 + 20
                                              for j in range(5 + submitted % 20)], p)
            submitted += 1
        if len(eng.trace) % 7 == 3 and eng.scheduler.running:
            eng.abort_request(eng.scheduler.running[-1].request_id)
            aborted += 1
        eng.step()
        sampled = {id(seqs[rid].output_token_ids) for rid, _ in eng.trace[-1].scheduled}
        assert set(tables._tables) <= sampled  # noqa: SLF001
        most = max(most, len(tables))
    assert aborted > 0 and eng.scheduler.num_preemptions > 0
    assert 0 < most <= 6
    eng.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
    assert len(tables) == 0
