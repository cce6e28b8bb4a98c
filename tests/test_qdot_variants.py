"""The integer kernel's builds (specmesh.kernels.qdot.VARIANTS): AVX2 and, where the CPU has it,
AVX512-VNNI. Each computes the kernel's stated arithmetic; their outputs are bit-identical, so the
choice between them, by timing per layout and row count, never changes a token; a variant made
slow is not chosen."""

from __future__ import annotations

import pytest
import torch

from specmesh.kernels import qdot
from tests.test_gguf_format import _reference

pytestmark = pytest.mark.skipif(not qdot.available(), reason=f"integer kernel unavailable: {qdot.reason()}")
FORMS = [(4, "fp32"), (4, "super"), (6, "super"), (4, "super16"), (6, "super16"), (8, "fp32"), (4, "half1"),
         (6, "half2"), (8, "half2"), (8, "half1")]
SEVERAL = pytest.mark.skipif(len(qdot.runnable()) < 2, reason="this CPU runs only the AVX2 build")


def _layer(bits: int, n: int, k: int, form: str, g: torch.Generator) -> tuple[qdot.Packed, tuple]:
    """A random layer in one (scale, bias) form: fp32 pairs, fp16 pairs per group (half1) or per
    two groups (half2: a GGUF 32-block in 16-groups), or K-quant super-blocks with fp32 (super) or,
    as GGUF files hold them, fp16 (super16) values of d and dm."""
    lo, hi = qdot.CODES[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16)
    gs = qdot.GROUP[bits]
    if not form.startswith("super"):
        share = 2 if form == "half2" else 1
        scale, offset = torch.rand(n, k // gs // share, generator=g) * 0.01, torch.randn(n, k // gs // share, generator=g) * 0.01
        if form != "fp32":
            scale, offset = (a.half().float().repeat_interleave(share, 1) for a in (scale, offset))
        p = qdot.pack(q, scale, offset, bits)
        assert (p.sb.dtype, p.s) == ((torch.float32, 0) if form == "fp32" else (torch.half, share))
        return p, (q, scale, offset)
    d, dm = torch.rand(n, k // 256, generator=g) * 1e-3, -torch.rand(n, k // 256, generator=g) * 1e-3
    if form == "super16":
        d, dm = d.half().float(), dm.half().float()
    sc = torch.randint(-64, 64, (n, k // gs), generator=g, dtype=torch.int8)
    mn = None if bits == 6 else torch.randint(0, 64, (n, k // gs), generator=g, dtype=torch.int8)
    p = qdot.pack_super(q, d, dm, sc, mn, bits)
    assert p.sb.dtype == (torch.half if form == "super16" else torch.float32)
    _, scale, offset = qdot.unpack(p)
    return p, (q, scale, offset)


@pytest.mark.parametrize("variant", qdot.runnable())
@pytest.mark.parametrize("bits,form", FORMS)
def test_each_variant_computes_the_stated_arithmetic(variant, bits, form):
    g = torch.Generator().manual_seed(bits)
    p, (q, scale, offset) = _layer(bits, 45, 512, form, g)  # 45 rows: a pair of blocks, a lone block, padding
    x = torch.randn(11, 512, generator=g)
    want = _reference(x, q, scale, offset)
    got = qdot._State.ops[variant](x, p.codes, p.sb, p.sc, p.n, p.bits, p.s, 1).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("variant", qdot.runnable())
def test_every_thread_split_covers_each_output_once_with_the_same_bits(variant):
    """The kernel pool (pool.h) splits a product's chunks into one contiguous run per thread, and a
    thread whose run is done takes what is left of the others'. More threads than cores, more than
    chunks, uneven runs: every output is written, by the same operations."""
    g = torch.Generator().manual_seed(7)
    op = qdot._State.ops[variant]
    for n in (8, 200, 3000):  # one chunk; a few; many, split unevenly
        p, (q, scale, offset) = _layer(4, n, 512, "super", g)
        x = torch.randn(3, 512, generator=g)
        alone = op(x, p.codes, p.sb, p.sc, p.n, p.bits, p.s, 1)
        want = _reference(x, q, scale, offset)
        assert (alone.double() - want).abs().max() <= 1e-5 * want.abs().max()
        for threads in (2, 3, 7):
            assert torch.equal(op(x, p.codes, p.sb, p.sc, p.n, p.bits, p.s, threads), alone), (n, threads)


@SEVERAL
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("bits,form", FORMS)
def test_variants_give_bit_identical_rows_alone_and_together(bits, form, threads):
    g = torch.Generator().manual_seed(100 + bits)
    for n in (24, 40, 1000):  # block pairs only, pairs + a lone block, a thread split
        p, _ = _layer(bits, n, 768, form, g)
        x = torch.randn(20, 768, generator=g)
        ys = {v: op(x, p.codes, p.sb, p.sc, p.n, p.bits, p.s, threads) for v, op in qdot._State.ops.items()}
        for v, y in ys.items():
            assert torch.equal(y, ys["avx2"]), (v, n)
            for m in (1, 2, 5, 9, 10, 11, 17, 18):  # a row alone, in a tree, in a batch (every tiling): the same bits
                assert torch.equal(qdot._State.ops[v](x[:m], p.codes, p.sb, p.sc, p.n, p.bits, p.s, threads), y[:m])


@SEVERAL
def test_a_variant_made_slow_is_not_chosen(monkeypatch):
    others = [v for v in qdot._State.ops if v != "avx2"]
    monkeypatch.setenv(qdot.TEST_DELAY_ENV, ",".join(f"{v}:3000" for v in others))
    choice = qdot.choose(qdot.time_variants(list(qdot._State.ops), reps=2))
    assert {v for cells in choice.values() for v in cells.values()} == {"avx2"}
    monkeypatch.setenv(qdot.TEST_DELAY_ENV, "avx2:3000")
    choice = qdot.choose(qdot.time_variants(list(qdot._State.ops), reps=2))
    assert "avx2" not in {v for cells in choice.values() for v in cells.values()}


def test_choose_keeps_avx2_unless_another_variant_wins_by_the_margin():
    timed = {"4": {"avx2": {str(m): 100.0 for m in qdot.ROWS},
                   "avx512vnni": {str(m): 100.0 * (1 - qdot.MARGIN / 2) if m < 5 else 50.0 for m in qdot.ROWS}}}
    cells = qdot.choose(timed)["4"]
    assert [cells[str(m)] for m in qdot.ROWS] == ["avx2" if m < 5 else "avx512vnni" for m in qdot.ROWS]
    assert qdot.describe_choice({"4": cells}) == "4-bit: avx2 at 1-4, avx512vnni at 5-17 rows"


def test_the_choice_routes_each_row_count_and_is_described(monkeypatch):
    monkeypatch.setattr(qdot._State, "choices", {})
    monkeypatch.setenv("SPECMESH_QDOT", "avx2")
    made = qdot.choice()
    assert made["table"]["forced"] == "avx2"
    assert all(op is qdot._State.ops["avx2"] for ops in made["by_bits"].values() for op in ops)
    assert len(made["by_bits"][4]) == qdot.ROWS[-1] + 1  # one entry per row count; more rows take the last
    assert "avx2 at 1-17 rows" in qdot.describe()["choice"]


@pytest.mark.parametrize("bits,form", [(4, "half1"), (6, "half2"), (8, "half2")])
def test_fp16_pairs_give_the_fp32_pairs_bits_in_fewer_bytes(bits, form):
    """GGUF Q4_0/Q4_1 (4-bit), Q5_* (6-bit) and Q8_0 (8-bit) scales are fp16 values: held as fp16
    pairs, shared by the two 16-groups of a 32-block, every output is the fp32 pairs' to the bit."""
    g = torch.Generator().manual_seed(7)
    p, (q, scale, offset) = _layer(bits, 40, 512, form, g)
    nb = p.codes.shape[0]
    by_block = lambda a: torch.nn.functional.pad(a, (0, 0, 0, nb * 8 - a.shape[0])).view(nb, 8, -1).permute(0, 2, 1)  # noqa: E731
    fp32 = qdot.Packed(p.codes, torch.stack([by_block(scale), by_block(offset)], 2).contiguous(), p.sc, p.n, p.k, bits)
    x = torch.randn(9, 512, generator=g)
    for v, op in qdot._State.ops.items():
        for threads in (1, 2):
            assert torch.equal(op(x, p.codes, p.sb, p.sc, p.n, bits, p.s, threads),
                               op(x, fp32.codes, fp32.sb, fp32.sc, fp32.n, bits, 0, threads)), (v, threads)
    bits_per_weight = 8 * (p.codes.numel() + p.sb.numel() * 2) / (nb * 8 * 512)
    assert bits_per_weight == {4: 5.0, 6: 7.0, 8: 9.0}[bits]  # fp32 pairs per 16-group: 6, 10, 12
    uq, us, uo = qdot.unpack(p)
    assert torch.equal(uq, q) and torch.equal(us, scale) and torch.equal(uo, offset)


@pytest.mark.parametrize("bits", [4, 6])
def test_fp16_super_blocks_give_the_fp32_ones_bits_in_fewer_bytes(bits):
    """A GGUF K-quant's d and dmin are fp16 values: held as fp16, every output is what the same
    super-blocks held in fp32 give, to the bit, at Q4_K 4.625 bits a weight (fp32: 4.75; the file
    4.5) and Q6_K 6.625 (6.75; 6.5625)."""
    g = torch.Generator().manual_seed(8)
    p, _ = _layer(bits, 40, 512, "super16", g)
    fp32 = qdot.Packed(p.codes, p.sb.float().contiguous(), p.sc, p.n, p.k, bits, p.s)
    x = torch.randn(9, 512, generator=g)
    for v, op in qdot._State.ops.items():
        for threads in (1, 2):
            for m in (1, 3, 9):
                assert torch.equal(op(x[:m], p.codes, p.sb, p.sc, p.n, bits, p.s, threads),
                                   op(x[:m], fp32.codes, fp32.sb, fp32.sc, fp32.n, bits, p.s, threads)), (v, threads, m)
    nb = p.codes.shape[0]
    bits_per_weight = 8 * (p.codes.numel() + p.sb.numel() * 2 + p.sc.numel()) / (nb * 8 * 512)
    assert bits_per_weight == {4: 4.625, 6: 6.625}[bits]
    assert all(torch.equal(a, b) for a, b in zip(qdot.unpack(p), qdot.unpack(fp32)))
