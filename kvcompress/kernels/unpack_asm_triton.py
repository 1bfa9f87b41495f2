"""Codes unpacked into half-float dot operands by inline PTX, several per instruction: the GPU twin of
`_phase` (decode_phase_triton) for int codes with a magic pattern (`byte_codes`) and for 4-bit codebook
levels (`byte_levels`).

Why hand-written PTX: Triton unpacks one code per element (a shift, an AND-OR and a byte permute to pair
two 16-bit operands in a register), which bounds the 2- and 4-bit kernels (BENCHMARKS.md). Here one
`prmt` gathers byte B of two words into one register, and each `lop3` ((t & mask) | magic) then yields two
operands at once, already paired as the dot reads them. `pack=2` hands each asm instance two elements
of the word tile; which two does not matter for the result (each output half comes from its own word),
only for speed. A 4-bit codebook is read the same way: the 16 levels' low bytes and high bytes sit in
8 registers, and `prmt` (a byte permute that picks from 8 bytes by 3-bit selectors) looks up four codes
at once; Triton's warp shuffle (`tl.gather`) took one shuffle plus index work per code. Triton's
interpreter cannot run PTX: the CPU path (and its tests) take `_phase`, whose result is the same bit for
bit (tests/test_gpu.py compares the two on the GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

# $0.. outputs (two half floats per register), then the inputs, two registers each (pack=2): words, the
# prmt selector, the magic pattern in both halves
_ASM4: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, u;\nprmt.b32 t, $2, $3, $4;\nlop3.b32 $0, t, 0x000F000F, $6, 0xEA;\n"
    "shr.u32 u, t, 4;\nlop3.b32 $1, u, 0x000F000F, $6, 0xEA;\n}")
_ASM2: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, u;\nprmt.b32 t, $4, $5, $6;\nlop3.b32 $0, t, 0x00030003, $8, 0xEA;\n"
    "shr.u32 u, t, 2;\nlop3.b32 $1, u, 0x00030003, $8, 0xEA;\n"
    "shr.u32 u, t, 4;\nlop3.b32 $2, u, 0x00030003, $8, 0xEA;\n"
    "shr.u32 u, t, 6;\nlop3.b32 $3, u, 0x00030003, $8, 0xEA;\n}")


@triton.jit
def byte_codes(w, B: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, DT: tl.constexpr):
    """The 8 // BITS codes held in byte B of every word of w (int32 tile, any shape), each as a tile of
    (code | MAGIC) read as DT (bf16: 128 + code, fp16: 1024 + code), lowest code first: phases
    B * 8 // BITS + j of `_phase`. Returns a tuple of 8 // BITS tiles of w's shape."""
    # prmt selector: byte B of the first word into bytes 0-1, of the second into bytes 2-3
    sel = tl.full(w.shape, B * 0x1111 + 0x4400, tl.int32)
    magic = tl.full(w.shape, MAGIC * 0x10001, tl.int32)
    # 16-bit integers out (a tuple of dtypes cannot be a constexpr argument), read as DT: no instruction
    if BITS == 4:
        lo, hi = tl.inline_asm_elementwise(_ASM4, "=r,=r,r,r,r,r,r,r", [w, sel, magic],
                                           dtype=(tl.int16, tl.int16), is_pure=True, pack=2)
        out = (lo.to(DT, bitcast=True), hi.to(DT, bitcast=True))
    else:
        tl.static_assert(BITS == 2)
        c0, c1, c2, c3 = tl.inline_asm_elementwise(_ASM2, "=r,=r,=r,=r,r,r,r,r,r,r", [w, sel, magic],
                                                   dtype=(tl.int16, tl.int16, tl.int16, tl.int16),
                                                   is_pure=True, pack=2)
        out = (c0.to(DT, bitcast=True), c1.to(DT, bitcast=True), c2.to(DT, bitcast=True),
               c3.to(DT, bitcast=True))
    return out


# $0, $1: the operands of phases 2B and 2B + 1 (two half floats each); $2, $3: two words; $4, $5: the prmt
# selector of byte B; $6.. the tables, two registers each (pack=2): low bytes of levels 0-3, 4-7, 8-11,
# 12-15, then the high bytes likewise. t = byte B of both words (nibbles: code 2B, 2B + 1 of the first
# word, then of the second); s = their low 3 bits (prmt selectors); m = 0xFF in the bytes whose code is
# >= 8 (prmt's sign-replicate mode on bit 3); lookups in levels 0-7 and 8-15 merged by m (lop3 0xD8:
# m ? b : a); then low and high bytes interleaved into the two operand pairs.
_ASM_LUT4: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t, s, m, u, a, b, lo, hi;\n"
    "prmt.b32 t, $2, $3, $4;\n"
    "and.b32 s, t, 0x7777;\n"
    "shl.b32 u, t, 4;\n"
    "prmt.b32 m, u, t, 0xD9C8;\n"
    "prmt.b32 a, $6, $8, s;\n"
    "prmt.b32 b, $10, $12, s;\n"
    "lop3.b32 lo, a, b, m, 0xD8;\n"
    "prmt.b32 a, $14, $16, s;\n"
    "prmt.b32 b, $18, $20, s;\n"
    "lop3.b32 hi, a, b, m, 0xD8;\n"
    "prmt.b32 $0, lo, hi, 0x6240;\n"
    "prmt.b32 $1, lo, hi, 0x7351;\n}")


@triton.jit
def table_tiles(lt, R: tl.constexpr, C: tl.constexpr):
    """The 8 table words at lt (streams.level_tables, one dtype's columns) as [R, C] int32 tiles, each
    loaded from one address. Load them once, before the loop over tiles, and run that loop in one stage:
    Triton then keeps the tiles in the layout the asm needs and ptxas loads each word once (compiled PTX
    and SASS, sm_90). A splat of a scalar, or a pipelined loop, sent every asm result through shared
    memory instead."""
    at = tl.zeros([R, C], tl.int32)
    t = ()
    for k in tl.static_range(8):
        t = t + (tl.load(lt + k + at),)
    return t


@triton.jit
def byte_levels(w, B: tl.constexpr, t, DT: tl.constexpr):
    """The codebook levels of the two 4-bit codes in byte B of every word of w (int32 tile), as DT tiles:
    phases 2B and 2B + 1 of `_phase` with a codebook; t: `table_tiles` of w's shape."""
    sel = tl.full(w.shape, B | ((4 + B) << 4), tl.int32)  # byte B of the first word, then of the second
    lo, hi = tl.inline_asm_elementwise(
        _ASM_LUT4, "=r,=r" + ",r" * 20, [w, sel, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7]],
        dtype=(tl.int16, tl.int16), is_pure=True, pack=2)
    return lo.to(DT, bitcast=True), hi.to(DT, bitcast=True)
