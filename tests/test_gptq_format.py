"""Pack/unpack round trips of GPTQ's integer packing, and the v1 <-> v2 zero conversion."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantprep.format.gptq import pack_cols, pack_rows, unpack_cols, unpack_rows, v1_to_v2_qzeros, v2_to_v1_qzeros

bits_st = st.sampled_from([4, 8])


@settings(max_examples=60, deadline=None)
@given(bits=bits_st, rows=st.integers(1, 6), cols=st.integers(1, 40), seed=st.integers(0, 2**31 - 1))
def test_rows_round_trip(bits, rows, cols, seed):
    per = 32 // bits
    codes = torch.randint(0, 1 << bits, (rows * per, cols), generator=torch.Generator().manual_seed(seed))
    packed = pack_rows(codes, bits)
    assert packed.dtype == torch.int32 and packed.shape == (rows, cols)
    assert torch.equal(unpack_rows(packed, bits).long(), codes)


@settings(max_examples=60, deadline=None)
@given(bits=bits_st, rows=st.integers(1, 6), cols=st.integers(1, 10), seed=st.integers(0, 2**31 - 1))
def test_cols_round_trip(bits, rows, cols, seed):
    per = 32 // bits
    zeros = torch.randint(0, 1 << bits, (rows, cols * per), generator=torch.Generator().manual_seed(seed))
    packed = pack_cols(zeros, bits)
    assert packed.shape == (rows, cols)
    assert torch.equal(unpack_cols(packed, bits).long(), zeros)


def test_pack_layout_is_gptqs():
    # Hand-computed: code k sits at bits [4k, 4k+4) of the int32, lowest first.
    codes = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]])
    assert pack_rows(codes, 4).item() == int("f7654321", 16) - 2**32


@settings(max_examples=60, deadline=None)
@given(bits=bits_st, seed=st.integers(0, 2**31 - 1))
def test_v1_v2_round_trip_and_symmetric_zero(bits, seed):
    zeros = torch.randint(0, 1 << bits, (3, 32), generator=torch.Generator().manual_seed(seed))
    v2 = pack_cols(zeros, bits)
    assert torch.equal(v1_to_v2_qzeros(v2_to_v1_qzeros(v2, bits), bits), v2)
    # v1 stores zero-1: for a symmetric zero (2**(bits-1)) every field is exactly one less.
    sym = torch.full((1, 32), 1 << (bits - 1))
    assert torch.equal(unpack_cols(v2_to_v1_qzeros(pack_cols(sym, bits), bits), bits).long(), sym - 1)
