"""Ways to invert the chunk's unit lower-triangular matrix in the GDN prep kernel (kernel 1), timed and checked.

    python benchmarks/gdn_prep_solve.py --out /tmp/gdn_prep_solve.json   # a scratch file; copy what you keep

Kernel 1 builds L = strict_tril(diag(beta) K K^T * Gamma) per 64-token chunk and stores A = (I + L)^-1.

On 16x16 blocks loaded apart (`_prep_blocked`; chapter 13 explains the block substitution):
- `landed`: chapter 13's kernel (`_prep_kernel`, with `_prepare`'s launch options): diagonal blocks by forward
  substitution on each 16x16 tile carrying D^T, the blocks below by block substitution in tf32 products.
- `blocked subst, tf32x3`: the same with the products in tf32x3 (about fp32's accuracy).
- `blocked subst carrying (D-I)^T, tf32 (round 12)`: round 12's kernel, whose substitution carried (D - I)^T: compiled,
  each of its steps converts two vectors' layouts (51 conversions in the kernel against the landed one's 41).
- `blocked series P, tf32`: diagonal blocks by the nilpotent series (I - L)(I + L^2)(I + L^4)(I + L^8) in precision P.
On the whole 64x64 tile (`_prep_tile`):
- `tile substitution`: the kernel before round 12: the four diagonal blocks by forward substitution on one [4, 16, 16]
  tile (15 steps of masked reductions across warps), merged with four 64x64 tf32 products.
- `tile series blocks`: the same, the diagonal blocks by the series in tf32.
- `tile series 64`: the series on the whole tile, (I - L)(I + L^2)...(I + L^32), ten 64x64 products.
- `no solve`: stores L itself, the floor (gates, K K^T, the store) a solve adds to.

Accuracy: the largest error of A against float64 `torch.linalg.solve_triangular`, over all chunks, in units of A's
largest entry, with A stored in fp32 (the solve's own error) and in the inputs' dtype, for random keys, keys sharing a
direction, nearly aligned keys, and the tests' hard chunks (keys sharing a direction, beta in (0.5, 1), no decay).
Timing: `triton.testing.do_bench` median at HyMo's shape (B=4, T=4096, H=40, K=32), bf16, at 1, 2 and 4 warps.
On CPU (TRITON_INTERPRET=1) it only checks accuracy at a small shape.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from need_gpu import check_out, need_gpu, need_triton, provenance  # the script beside this one

need_triton()
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hymo.models.gdn_triton as gt  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _solve_unit_lower(b_L, BT: tl.constexpr):
    "The solve before round 12: (I + L)^-1 of a strictly lower fp32 tile [64, 64], the 16x16 diagonal blocks by substitution on one [4, 16, 16] tile, merged."
    tl.static_assert(BT == 64, "the merge (I - N)(I + N^2) assumes four 16x16 blocks")
    NB: tl.constexpr = BT // 16
    o_b = tl.arange(0, NB)
    o_j = tl.arange(0, 16)
    m_bd = o_b[:, None, None, None] == o_b[None, None, :, None]                      # same block, [NB, 1, NB, 1]
    b_Ld = tl.sum(tl.where(m_bd, tl.reshape(b_L, (NB, 16, NB, 16)), 0.), 2)        # diagonal blocks [NB, 16, 16]
    b_D = tl.zeros([NB, 16, 16], dtype=tl.float32)                                  # D - I, rows >= i still zero
    for i in range(1, 16):
        b_l = tl.sum(tl.where(o_j[None, :, None] == i, b_Ld, 0.), 1)               # row i of every block [NB, 16]
        b_a = -b_l - tl.sum(b_l[:, :, None] * b_D, 1)
        b_D = tl.where(o_j[None, :, None] == i, b_a[:, None, :], b_D)
    b_D += (o_j[:, None] == o_j[None, :]).to(tl.float32)[None, :, :]
    b_D = tl.reshape(tl.where(m_bd, b_D[:, :, None, :], 0.), (BT, BT))             # block diagonal [BT, BT]
    o_i = tl.arange(0, BT)
    b_N = tl.dot(b_D, tl.where((o_i[:, None] // 16) > (o_i[None, :] // 16), b_L, 0.))   # N = D L_off
    b_X = b_D + tl.dot(tl.dot(b_N, b_N), b_D)                                        # X = (I + N^2) D
    return b_X - tl.dot(b_N, b_X)                                                    # A = (I - N) X


@triton.jit
def _series16(b_L, b_I, PREC: tl.constexpr):
    "(I + L)^-1 of strictly lower 16x16 tiles (batched [NB, 16, 16] or one [16, 16]; `b_I` the identity of that shape)."
    b_L2 = tl.dot(b_L, b_L, input_precision=PREC)
    b_L4 = tl.dot(b_L2, b_L2, input_precision=PREC)
    b_D = tl.dot(b_I - b_L, b_I + b_L2, input_precision=PREC)
    b_D = tl.dot(b_D, b_I + b_L4, input_precision=PREC)
    b_L8 = tl.dot(b_L4, b_L4, input_precision=PREC)
    return tl.dot(b_D, b_I + b_L8, input_precision=PREC)


@triton.jit
def _solve_tile_series_blocks(b_L, BT: tl.constexpr):
    "As `_solve_unit_lower`, the diagonal blocks by the series in batched [4, 16, 16] tf32 products."
    NB: tl.constexpr = BT // 16
    o_b = tl.arange(0, NB)
    m_bd = o_b[:, None, None, None] == o_b[None, None, :, None]
    o_j = tl.arange(0, 16)
    b_I = tl.broadcast_to((o_j[:, None] == o_j[None, :]).to(tl.float32)[None, :, :], (NB, 16, 16))
    b_D = _series16(tl.sum(tl.where(m_bd, tl.reshape(b_L, (NB, 16, NB, 16)), 0.), 2), b_I, "tf32")
    b_D = tl.reshape(tl.where(m_bd, b_D[:, :, None, :], 0.), (BT, BT))
    o_i = tl.arange(0, BT)
    b_N = tl.dot(b_D, tl.where((o_i[:, None] // 16) > (o_i[None, :] // 16), b_L, 0.))
    b_X = b_D + tl.dot(tl.dot(b_N, b_N), b_D)
    return b_X - tl.dot(b_N, b_X)


@triton.jit
def _solve_tile_series_64(b_L, BT: tl.constexpr):
    "(I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8)(I + L^16)(I + L^32) for strictly lower L [64, 64]."
    o_i = tl.arange(0, BT)
    b_I = (o_i[:, None] == o_i[None, :]).to(tl.float32)
    b_P = b_L
    b_X = b_I - b_L
    for _ in tl.static_range(5):
        b_P = tl.dot(b_P, b_P)
        b_X = tl.dot(b_X, b_I + b_P)
    return b_X


@triton.jit
def _prep_tile(k, g, beta, gc, A, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, SOLVE: tl.constexpr):
    "Kernel 1 as it was before round 12 (no packed documents): L on one [64, 64] tile, solved by SOLVE (0..3)."
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b * T
    o_i = tl.arange(0, BT)
    o_t = i_t * BT + o_i
    m_t = o_t < T
    b_g = tl.cumsum(tl.load(g + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32), 0)
    tl.store(gc + (bos + o_t) * H + i_h, b_g, mask=m_t)
    b_beta = tl.load(beta + (bos + o_t) * H + i_h, mask=m_t, other=0.).to(tl.float32)
    p_k, m_k = gt._tile(k + (bos * H + i_h) * K, i_t * BT, T, H * K, 0, K, BT, K)
    b_k = tl.load(p_k, mask=m_k, other=0.)
    m_L = (o_i[:, None] > o_i[None, :]) & m_t[:, None]
    b_L = tl.dot(b_k, tl.trans(b_k)) * b_beta[:, None] * gt._decay_tril(b_g, m_L, BT)
    if SOLVE == 0: b_A = _solve_unit_lower(b_L, BT)
    elif SOLVE == 1: b_A = _solve_tile_series_blocks(b_L, BT)
    elif SOLVE == 2: b_A = _solve_tile_series_64(b_L, BT)
    else: b_A = b_L
    p_A, m_A = gt._tile(A + (bos * H + i_h) * BT, i_t * BT, T, H * BT, 0, BT, BT, BT)
    tl.store(p_A, b_A.to(A.dtype.element_ty), mask=m_A)


@triton.jit
def _inv16_et(b_L):
    """Round 12's substitution: as `gt._inv16`, but carrying E^T = (D - I)^T from zeros and subtracting row i of L
    itself, which lies along the other axis than the sum: compiled, every step converts two vectors' layouts."""
    o = tl.arange(0, 16)
    b_ET = tl.zeros([16, 16], dtype=tl.float32)
    for i in range(1, 16):
        b_l = tl.sum(tl.where(o[:, None] == i, b_L, 0.), 0)
        b_e = -b_l - tl.sum(b_ET * b_l[None, :], 1)
        b_ET = tl.where(o[None, :] == i, b_e[:, None], b_ET)
    return tl.trans(b_ET) + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _inv(b_L, SUBST: tl.constexpr, DPREC: tl.constexpr):
    "SUBST 1: the landed substitution (carrying D^T); 2: round 12's, carrying (D - I)^T; 0: the series in DPREC."
    if SUBST == 1: return gt._inv16(b_L)
    elif SUBST == 2: return _inv16_et(b_L)
    else:
        o = tl.arange(0, 16)
        return _series16(b_L, (o[:, None] == o[None, :]).to(tl.float32), DPREC)


@triton.jit
def _prep_blocked(k, g, beta, gc, A, T, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                  SUBST: tl.constexpr, DPREC: tl.constexpr, PREC: tl.constexpr):
    "Chapter 13's kernel 1 (no packed documents) with the diagonal blocks by substitution or by the series in DPREC, products in PREC."
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    bos = i_b * T
    g0, s0, m0, c = gt._gates16(g, beta, gc, bos, T, i_t, i_h, 0, 0., H, BT)
    g1, s1, m1, c = gt._gates16(g, beta, gc, bos, T, i_t, i_h, 1, c, H, BT)
    g2, s2, m2, c = gt._gates16(g, beta, gc, bos, T, i_t, i_h, 2, c, H, BT)
    g3, s3, m3, c = gt._gates16(g, beta, gc, bos, T, i_t, i_h, 3, c, H, BT)
    k0, k1 = gt._keys16(k, bos, T, i_t, i_h, 0, H, K, BT), gt._keys16(k, bos, T, i_t, i_h, 1, H, K, BT)
    k2, k3 = gt._keys16(k, bos, T, i_t, i_h, 2, H, K, BT), gt._keys16(k, bos, T, i_t, i_h, 3, H, K, BT)
    D0 = _inv(gt._L16(k0, k0, g0, g0, s0, m0, True), SUBST, DPREC)
    D1 = _inv(gt._L16(k1, k1, g1, g1, s1, m1, True), SUBST, DPREC)
    D2 = _inv(gt._L16(k2, k2, g2, g2, s2, m2, True), SUBST, DPREC)
    D3 = _inv(gt._L16(k3, k3, g3, g3, s3, m3, True), SUBST, DPREC)
    L10, L21 = gt._L16(k1, k0, g1, g0, s1, m1, False), gt._L16(k2, k1, g2, g1, s2, m2, False)
    L32, L20 = gt._L16(k3, k2, g3, g2, s3, m3, False), gt._L16(k2, k0, g2, g0, s2, m2, False)
    L31, L30 = gt._L16(k3, k1, g3, g1, s3, m3, False), gt._L16(k3, k0, g3, g0, s3, m3, False)
    A10, A20, A21, A30, A31, A32 = gt._below_diagonal(D0, D1, D2, D3, L10, L20, L21, L30, L31, L32, PREC)
    gt._store_A(A, D0, D1, D2, D3, A10, A20, A21, A30, A31, A32, bos, T, i_t, i_h, H, BT)


VARIANTS = {  # name: ("tile", SOLVE) | ("blocked", SUBST, DPREC, PREC) | ("landed",)
    "landed": ("landed",),
    "blocked subst, tf32x3": ("blocked", 1, "tf32", "tf32x3"),
    "blocked subst carrying (D-I)^T, tf32 (round 12)": ("blocked", 2, "tf32", "tf32"),
    "blocked series tf32, tf32": ("blocked", 0, "tf32", "tf32"),
    "blocked series tf32x3, tf32": ("blocked", 0, "tf32x3", "tf32"),
    "blocked series ieee, tf32": ("blocked", 0, "ieee", "tf32"),
    "tile substitution": ("tile", 0),
    "tile series blocks": ("tile", 1),
    "tile series 64": ("tile", 2),
    "no solve": ("tile", 3),
}


def prep(k, g, beta, variant, num_warps=None, out_dtype=None):
    "Run kernel 1 as `variant` does: `(gc, A)`."
    B, T, H, K = k.shape
    kind, *args = variant
    gc = torch.empty(B, T, H, dtype=torch.float32, device=k.device)
    A = torch.empty(B, T, H, gt.BT, dtype=out_dtype or k.dtype, device=k.device)
    grid = (triton.cdiv(T, gt.BT), B * H)
    if kind == "landed":  # as `_prepare` launches it, into an A of any dtype
        launch = dict(gt.LAUNCH["prep"], **({"num_warps": num_warps} if num_warps else {}))
        gt._prep_kernel[grid](k, g, beta, gc, A, None, None, None, T, H, K, gt.BT, False, **launch)
    else:
        kernel = _prep_blocked if kind == "blocked" else _prep_tile
        kernel[grid](k, g, beta, gc, A, T, H, K, gt.BT, *args, num_warps=num_warps or 4)
    return gc, A


def inputs(B, T, H, K, dtype, common=0.0, seed=0, hard=False):
    """Normalised keys (`common` > 0 adds a shared direction: larger, worse-conditioned inverses), HyMo-like gates;
    `hard`: the tests' hard chunks, beta in (0.5, 1) and no decay."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=DEV)
    k = F.normalize(r(B, T, H, K) + common * r(1, 1, H, K), dim=-1).to(dtype)
    g = torch.zeros(B, T, H, device=DEV) if hard else F.logsigmoid(r(B, T, H) + 3)
    beta = torch.rand(B, T, H, generator=gen, device=DEV)
    return k, g, (0.5 + 0.5 * beta) if hard else beta


def exact_A(k, g, beta):
    "float64 (I + L)^-1 of every chunk: [B, NT, H, 64, 64]."
    B, T, H, K = k.shape
    C = gt.BT
    kk = k.double().view(B, T // C, C, H, K).transpose(2, 3)                        # (B, NT, H, C, K)
    G = g.double().view(B, T // C, C, H).transpose(2, 3).cumsum(-1)
    bt = beta.double().view(B, T // C, C, H).transpose(2, 3)
    low = torch.ones(C, C, dtype=torch.bool, device=k.device).tril(-1)
    L = (bt[..., None] * (kk @ kk.transpose(-1, -2)) * (G[..., :, None] - G[..., None, :]).masked_fill(~low, -torch.inf).exp())
    eye = torch.eye(C, dtype=torch.float64, device=k.device)
    return torch.linalg.solve_triangular(eye + L, eye.expand_as(L), upper=False)


def error(k, g, beta, variant):
    "Largest |A - exact| over A's largest |entry|, for A stored in fp32 (the solve's own error) and in k's dtype."
    B, T, H, K = k.shape
    ref = exact_A(k, g, beta)
    out = {}
    for name, dt in (("fp32", torch.float32), ("stored", k.dtype)):
        _, A = prep(k, g, beta, variant, out_dtype=dt)
        A = A.double().view(B, T // gt.BT, gt.BT, H, gt.BT).transpose(2, 3)
        out[name] = ((A - ref).abs().amax() / ref.abs().amax()).item()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    check_out(ap, args.out)
    need_gpu("set TRITON_INTERPRET=1 to check the solves' accuracy at a small shape", interpreter_ok=True)
    gpu = DEV == "cuda"
    B, T, H, K = (4, 4096, 40, 32) if gpu else (1, 128, 2, 32)
    dtype = torch.bfloat16 if gpu else torch.float32
    res = dict(meta=dict(**provenance(), device=torch.cuda.get_device_name() if gpu else "cpu (interpreter)", shape=dict(B=B, T=T, H=H, K=K), dtype=str(dtype),
                         error="max |A - float64 solve| / max |A|, A stored in fp32 and in the inputs' dtype"), variants={})
    cases = {"random keys": inputs(B, T, H, K, dtype), "keys with a common direction": inputs(B, T, H, K, dtype, common=1.0, seed=1),
             "keys nearly aligned": inputs(B, T, H, K, dtype, common=4.0, seed=2),
             "hard chunks (beta > 0.5, no decay)": inputs(B, T, H, K, dtype, common=3.0, seed=3, hard=True)}
    for name, variant in VARIANTS.items():
        r = res["variants"][name] = {}
        for case, xs in cases.items():
            try: r[case] = error(*xs, variant)
            except Exception as e: r[case] = {"error": repr(e)[:300]}
        if gpu:
            from triton.testing import do_bench
            k, g, beta = cases["random keys"]
            for w in (1, 2, 4):
                try: r[f"ms (num_warps={w})"] = do_bench(lambda: prep(k, g, beta, variant, w), return_mode="median")
                except Exception as e: r[f"ms (num_warps={w})"] = repr(e)[:300]
        print(name, json.dumps(r), flush=True)
    if args.out: Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
