"""First-fit-decreasing packing: layout, the shift across seams, padding, boundaries, and the samples it takes."""

import pytest
import torch

from agentrl.train.pack import first_fit_decreasing, pack_samples
from agentrl.sample import TrainingSample


def _sample(ids, trainable, advantage=0.0, version=0):
    behaviour = [-0.5 * (k + 1) if t else 0.0 for k, t in enumerate(trainable)]
    return TrainingSample(list(ids), list(trainable), behaviour, [version if t else -1 for t in trainable],
                       advantage=advantage)


def test_ffd_places_longest_first_into_the_first_row_with_room():
    # capacity 10: 7 -> row0, 6 -> row1, 4 -> row1 (row0 has 3 left), 3 -> row0, 3 -> row2, 1 -> row2
    assert first_fit_decreasing([3, 7, 1, 4, 6, 3], 10) == [[1, 0], [4, 3], [5, 2]]
    assert first_fit_decreasing([5, 5, 5], 5) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="sample 1 has 11 tokens, more than a row holds"):
        first_fit_decreasing([3, 11], 10)


def test_layout_positions_and_boundaries():
    a = _sample(range(10, 15), [0, 0, 1, 1, 1], advantage=1.5, version=3)  # 5 tokens
    b = _sample(range(20, 23), [0, 1, 1], advantage=-2.0, version=4)  # 3 tokens
    c = _sample(range(30, 36), [0, 0, 0, 1, 0, 1], advantage=0.5, version=5)  # 6 tokens
    batch = pack_samples([a, b, c], row_tokens=9, pad_token_id=99)
    assert batch.rows == [[2, 1], [0]]
    assert batch.shape == (2, 9) and batch.num_tokens == 14 and batch.num_samples == 3
    assert batch.input_ids[0].tolist() == [30, 31, 32, 33, 34, 35, 20, 21, 22]
    assert batch.input_ids[1].tolist() == [10, 11, 12, 13, 14, 99, 99, 99, 99]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert [c.tolist() for c in batch.cu_seqlens] == [[0, 6, 9], [0, 5, 9]]
    assert batch.segments == [[(2, 0, 6), (1, 6, 3)], [(0, 0, 5)]]
    assert batch.flat_cu_seqlens().tolist() == [0, 6, 9, 14, 18]

    # target side: position t predicts t + 1 inside a sample; each sample's last position predicts nothing
    assert batch.target_ids[0].tolist() == [31, 32, 33, 34, 35, 0, 21, 22, 0]
    assert batch.loss_mask[0].tolist() == [False, False, True, False, True, False, True, True, False]
    assert batch.loss_mask[1].tolist() == [False, True, True, True, False, False, False, False, False]
    assert batch.advantages[0].tolist() == [0, 0, 0.5, 0, 0.5, 0, -2.0, -2.0, 0]
    assert batch.versions[0].tolist() == [-1, -1, 5, -1, 5, -1, 4, 4, -1]
    assert batch.sample_index[0].tolist() == [-1, -1, 2, -1, 2, -1, 1, 1, -1]
    assert batch.behaviour_logprobs[1].tolist() == [0.0, -1.5, -2.0, -2.5, 0, 0, 0, 0, 0]


def test_no_target_crosses_a_seam_and_padding_is_masked():
    g = torch.Generator().manual_seed(0)
    samples = []
    for k in range(12):
        n = int(torch.randint(2, 12, (1,), generator=g))
        trainable = [0] + torch.randint(0, 2, (n - 1,), generator=g).tolist()
        samples.append(_sample(torch.randint(0, 50, (n,), generator=g).tolist(), trainable, advantage=float(k)))
    batch = pack_samples(samples, row_tokens=16, pad_to_multiple=8)
    assert batch.shape[1] % 8 == 0
    assert all(sum(len(samples[i]) for i in row) <= 16 for row in batch.rows)
    assert sorted(i for row in batch.rows for i in row) == list(range(12))
    for r, segs in enumerate(batch.segments):
        used = 0
        for i, start, n in segs:
            s = samples[i]
            # every trained target lies inside its own sample, and is exactly that sample's trainable tokens
            assert batch.loss_mask[r, start + n - 1].item() is False
            assert batch.target_ids[r, start:start + n - 1].tolist() == s.input_ids[1:]
            assert batch.loss_mask[r, start:start + n - 1].tolist() == [bool(t) for t in s.trainable[1:]]
            used = start + n
        assert not batch.loss_mask[r, used:].any() and (batch.versions[r, used:] == -1).all()
    tokens = batch.trainable_tokens()
    assert len(tokens) == sum(s.num_trainable for s in samples) == batch.num_trainable
    assert torch.equal(tokens.advantages, tokens.sample_index.float())  # advantage k belongs to sample k


def test_packing_is_a_pure_function_of_the_samples():
    samples = [_sample(range(n), [0] + [1] * (n - 1)) for n in (4, 6, 4, 2, 6)]
    one, two = pack_samples(samples, 10), pack_samples(samples, 10)
    assert one.rows == two.rows and torch.equal(one.input_ids, two.input_ids)
    assert one.rows == [[1, 0], [4, 2], [3]]  # equal lengths keep their order


def test_errors():
    with pytest.raises(ValueError, match="raise row_tokens"):
        pack_samples([_sample(range(5), [0, 1, 1, 1, 1])], row_tokens=4)
    with pytest.raises(ValueError, match="at least one sample"):
        pack_samples([], row_tokens=4)
    with pytest.raises(ValueError, match="first token cannot be trainable"):
        _sample(range(3), [1, 1, 1])
    with pytest.raises(ValueError, match="versions has 2 entries"):
        TrainingSample([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0], [-1, 0])
    with pytest.raises(ValueError, match="non-finite behaviour logprob"):
        TrainingSample([1, 2], [0, 1], [0.0, float("-inf")], [-1, 0])
    with pytest.raises(ValueError, match="policy version -1"):
        TrainingSample([1, 2], [0, 1], [0.0, -1.0], [-1, -1])
