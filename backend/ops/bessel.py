"""Bessel functions and Airy's Ai, as torch.special has them: jax.scipy.special where it has the function, else
Cephes' rational and Chebyshev approximations (as PyTorch's kernels use them), one branch per range, chosen
with `jnp.where`."""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.special as jss
import torch

from ..core.registry import lower
from .special import as_float

aten = torch.ops.aten


# --- Bessel functions --------------------------------------------------------------


@lower(aten.special_modified_bessel_i0)
def modified_bessel_i0(self):
    return jss.i0(as_float(self))


@lower(aten.special_modified_bessel_i1)
def modified_bessel_i1(self):
    return jss.i1(as_float(self))


@lower(aten.special_spherical_bessel_j0)
def spherical_bessel_j0(self):
    x = as_float(self)
    # sin(x)/x, with its Taylor series near 0 (as PyTorch does below |x| = 0.5).
    x2 = x * x
    series = 1 - x2 / 6 * (1 - x2 / 20 * (1 - x2 / 42 * (1 - x2 / 72 * (1 - x2 / 110 * (1 - x2 / 156)))))
    safe = jnp.where(jnp.abs(x) < 0.5, 1, x)
    return jnp.where(jnp.isinf(x), 0, jnp.where(jnp.abs(x) < 0.5, series, jnp.sin(safe) / safe))


def _polevl(x, coeffs):
    """Horner: coeffs[0] x^(n-1) + ... + coeffs[-1]."""
    out = jnp.zeros_like(x)
    for c in coeffs:
        out = out * x + c
    return out


def _chbevl(t, coeffs):
    """Cephes' Chebyshev series (Clenshaw), as PyTorch's kernels unroll it."""
    a, p, q = jnp.full_like(t, coeffs[0]), jnp.zeros_like(t), jnp.zeros_like(t)
    for c in coeffs[1:]:
        p, q = q, a
        a = t * q - p + c
    return 0.5 * (a - p)


# Cephes coefficients, as in PyTorch's aten/src/ATen/native/Math.h.
_J0_PP = (7.96936729297347051624e-04, 8.28352392107440799803e-02, 1.23953371646414299388e+00,
          5.44725003058768775090e+00, 8.74716500199817011941e+00, 5.30324038235394892183e+00,
          9.99999999999999997821e-01)
_J0_PQ = (9.24408810558863637013e-04, 8.56288474354474431428e-02, 1.25352743901058953537e+00,
          5.47097740330417105182e+00, 8.76190883237069594232e+00, 5.30605288235394617618e+00,
          1.00000000000000000218e+00)
_J0_QP = (-1.13663838898469149931e-02, -1.28252718670509318512e+00, -1.95539544257735972385e+01,
          -9.32060152123768231369e+01, -1.77681167980488050595e+02, -1.47077505154951170175e+02,
          -5.14105326766599330220e+01, -6.05014350600728481186e+00)
_J0_QQ = (6.43178256118178023184e+01, 8.56430025976980587198e+02, 3.88240183605401609683e+03,
          7.24046774195652478189e+03, 5.93072701187316984827e+03, 2.06209331660327847417e+03,
          2.42005740240291393179e+02)
_J0_RP = (-4.79443220978201773821e+09, 1.95617491946556577543e+12, -2.49248344360967716204e+14,
          9.70862251047306323952e+15)
_J0_RQ = (4.99563147152651017219e+02, 1.73785401676374683123e+05, 4.84409658339962045305e+07,
          1.11855537045356834862e+10, 2.11277520115489217587e+12, 3.10518229857422583814e+14,
          3.18121955943204943306e+16, 1.71086294081043136091e+18)
_Y0_YP = (1.55924367855235737965e+04, -1.46639295903971606143e+07, 5.43526477051876500413e+09,
          -9.82136065717911466409e+11, 8.75906394395366999549e+13, -3.46628303384729719441e+15,
          4.42733268572569800351e+16, -1.84950800436986690637e+16)
_Y0_YQ = (1.04128353664259848412e+03, 6.26107330137134956842e+05, 2.68919633393814121987e+08,
          8.64002487103935000337e+10, 2.02979612750105546709e+13, 3.17157752842975028269e+15,
          2.50596256172653059228e+17)
_J1_PP = (7.62125616208173112003e-04, 7.31397056940917570436e-02, 1.12719608129684925192e+00,
          5.11207951146807644818e+00, 8.42404590141772420927e+00, 5.21451598682361504063e+00,
          1.00000000000000000254e+00)
_J1_PQ = (5.71323128072548699714e-04, 6.88455908754495404082e-02, 1.10514232634061696926e+00,
          5.07386386128601488557e+00, 8.39985554327604159757e+00, 5.20982848682361821619e+00,
          9.99999999999999997461e-01)
_J1_QP = (5.10862594750176621635e-02, 4.98213872951233449420e+00, 7.58238284132545283818e+01,
          3.66779609360150777800e+02, 7.10856304998926107277e+02, 5.97489612400613639965e+02,
          2.11688757100572135698e+02, 2.52070205858023719784e+01)
_J1_QQ = (7.42373277035675149943e+01, 1.05644886038262816351e+03, 4.98641058337653607651e+03,
          9.56231892404756170795e+03, 7.99704160447350683650e+03, 2.82619278517639096600e+03,
          3.36093607810698293419e+02)
_J1_RP = (-8.99971225705559398224e+08, 4.52228297998194034323e+11, -7.27494245221818276015e+13,
          3.68295732863852883286e+15)
_J1_RQ = (6.20836478118054335476e+02, 2.56987256757748830383e+05, 8.35146791431949253037e+07,
          2.21511595479792499675e+10, 4.74914122079991414898e+12, 7.84369607876235854894e+14,
          8.95222336184627338078e+16, 5.32278620332680085395e+18)
_Y1_YP = (1.26320474790178026440e+09, -6.47355876379160291031e+11, 1.14509511541823727583e+14,
          -8.12770255501325109621e+15, 2.02439475713594898196e+17, -7.78877196265950026825e+17)
_Y1_YQ = (5.94301592346128195359e+02, 2.35564092943068577943e+05, 7.34811944459721705660e+07,
          1.87601316108706159478e+10, 3.88231277496238566008e+12, 6.20557727146953693363e+14,
          6.87141087355300489866e+16, 3.97270608116560655612e+18)
_K0_A = (1.37446543561352307156e-16, 4.25981614279661018399e-14, 1.03496952576338420167e-11,
         1.90451637722020886025e-09, 2.53479107902614945675e-07, 2.28621210311945178607e-05,
         1.26461541144692592338e-03, 3.59799365153615016266e-02, 3.44289899924628486886e-01,
         -5.35327393233902768720e-01)
_K0_B = (5.30043377268626276149e-18, -1.64758043015242134646e-17, 5.21039150503902756861e-17,
         -1.67823109680541210385e-16, 5.51205597852431940784e-16, -1.84859337734377901440e-15,
         6.34007647740507060557e-15, -2.22751332699166985548e-14, 8.03289077536357521100e-14,
         -2.98009692317273043925e-13, 1.14034058820847496303e-12, -4.51459788337394416547e-12,
         1.85594911495471785253e-11, -7.95748924447710747776e-11, 3.57739728140030116597e-10,
         -1.69753450938905987466e-09, 8.57403401741422608519e-09, -4.66048989768794782956e-08,
         2.76681363944501510342e-07, -1.83175552271911948767e-06, 1.39498137188764993662e-05,
         -1.28495495816278026384e-04, 1.56988388573005337491e-03, -3.14481013119645005427e-02,
         2.44030308206595545468e+00)
_K1_A = (-7.02386347938628759343e-18, -2.42744985051936593393e-15, -6.66690169419932900609e-13,
         -1.41148839263352776110e-10, -2.21338763073472585583e-08, -2.43340614156596823496e-06,
         -1.73028895751305206302e-04, -6.97572385963986435018e-03, -1.22611180822657148235e-01,
         -3.53155960776544875667e-01, 1.52530022733894777053e+00)
_K1_B = (-5.75674448366501715755e-18, 1.79405087314755922667e-17, -5.68946255844285935196e-17,
         1.83809354436663880070e-16, -6.05704724837331885336e-16, 2.03870316562433424052e-15,
         -7.01983709041831346144e-15, 2.47715442448130437068e-14, -8.97670518232499435011e-14,
         3.34841966607842919884e-13, -1.28917396095102890680e-12, 5.13963967348173025100e-12,
         -2.12996783842756842877e-11, 9.21831518760500529508e-11, -4.19035475934189648750e-10,
         2.01504975519703286596e-09, -1.03457624656780970260e-08, 5.74108412545004946722e-08,
         -3.50196060308781257119e-07, 2.40648494783721712015e-06, -1.93619797416608296024e-05,
         1.95215518471351631108e-04, -2.85781685962277938680e-03, 1.03923736576817238437e-01,
         2.72062619048444266945e+00)
_AIRY_AN = (3.46538101525629032477e-01, 1.20075952739645805542e+01, 7.62796053615234516538e+01,
            1.68089224934630576269e+02, 1.59756391350164413639e+02, 7.05360906840444183113e+01,
            1.40264691163389668864e+01, 9.99999999999999995305e-01)
_AIRY_AD = (5.67594532638770212846e-01, 1.47562562584847203173e+01, 8.45138970141474626562e+01,
            1.77318088145400459522e+02, 1.64234692871529701831e+02, 7.14778400825575695274e+01,
            1.40959135607834029598e+01, 1.00000000000000000470e+00)
_AIRY_AFN = (-1.31696323418331795333e-01, -6.26456544431912369773e-01, -6.93158036036933542233e-01,
             -2.79779981545119124951e-01, -4.91900132609500318020e-02, -4.06265923594885404393e-03,
             -1.59276496239262096340e-04, -2.77649108155232920844e-06, -1.67787698489114633780e-08)
_AIRY_AFD = (1.33560420706553243746e+01, 3.26825032795224613948e+01, 2.67367040941499554804e+01,
             9.18707402907259625840e+00, 1.47529146771666414581e+00, 1.15687173795188044134e-01,
             4.40291641615211203805e-03, 7.54720348287414296618e-05, 4.51850092970580378464e-07)
_AIRY_AGN = (1.97339932091685679179e-02, 3.91103029615688277255e-01, 1.06579897599595591108e+00,
             9.39169229816650230044e-01, 3.51465656105547619242e-01, 6.33888919628925490927e-02,
             5.85804113048388458567e-03, 2.82851600836737019778e-04, 6.98793669997260967291e-06,
             8.11789239554389293311e-08, 3.41551784765923618484e-10)
_AIRY_AGD = (9.30892908077441974853e+00, 1.98352928718312140417e+01, 1.55646628932864612953e+01,
             5.47686069422975497931e+00, 9.54293611618961883998e-01, 8.64580826352392193095e-02,
             4.12656523824222607191e-03, 1.01259085116509135510e-04, 1.17166733214413521882e-06,
             4.91834570062930015649e-09)

_SQRT_2_OVER_PI = 0.797884560802865355879892119868763737
_TWO_OVER_PI = 0.636619772367581343075535053490057448
_PI_4 = 0.785398163397448309615660845819875721
_3PI_4 = 2.356194490192344928846982537459627163


def _bessel_asymptotic(x, pp, pq, qp, qq, shift, sine):
    """The large-x form shared by J0/Y0 (shift pi/4) and J1/Y1 (shift 3 pi/4)."""
    big = jnp.where(x > 5, x, 10.0)
    w = 25.0 / (big * big)
    p = _polevl(w, pp) / _polevl(w, pq)
    q = _polevl(w, qp) / _polevl(w, qq)
    if sine:  # Y: P sin + (5/x) Q cos
        v = p * jnp.sin(big - shift) + 5.0 / big * q * jnp.cos(big - shift)
    else:  # J: P cos - (5/x) Q sin
        v = p * jnp.cos(big - shift) - 5.0 / big * q * jnp.sin(big - shift)
    return v * _SQRT_2_OVER_PI / jnp.sqrt(big)


def _j0(x):
    x = jnp.abs(x)
    z = x * x
    small = (z - 5.78318596294678452118e+00) * (z - 3.04712623436620863991e+01) * _polevl(z, _J0_RP) / _polevl(z, _J0_RQ)
    small = jnp.where(x < 1e-5, 1 - z / 4, small)
    return jnp.where(x <= 5, small, _bessel_asymptotic(x, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_4, False))


def _j1(x):
    sign = jnp.where(x < 0, -1.0, 1.0).astype(x.dtype)
    x = jnp.abs(x)
    z = x * x
    small = _polevl(z, _J1_RP) / _polevl(z, _J1_RQ) * x * (z - 1.46819706421238932572e+01) * (z - 4.92184563216946036703e+01)
    return sign * jnp.where(x <= 5, small, _bessel_asymptotic(x, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PI_4, False))


@lower(aten.special_bessel_j0)
def bessel_j0(self):
    return _j0(as_float(self))


@lower(aten.special_bessel_j1)
def bessel_j1(self):
    return _j1(as_float(self))


@lower(aten.special_bessel_y0)
def bessel_y0(self):
    x = as_float(self)
    z = x * x
    small = _polevl(z, _Y0_YP) / _polevl(z, _Y0_YQ) + _TWO_OVER_PI * jnp.log(x) * _j0(x)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    return jnp.where(x <= 5, small, _bessel_asymptotic(x, _J0_PP, _J0_PQ, _J0_QP, _J0_QQ, _PI_4, True))


@lower(aten.special_bessel_y1)
def bessel_y1(self):
    x = as_float(self)
    z = x * x
    safe = jnp.where(x > 0, x, 1.0)
    small = safe * (_polevl(z, _Y1_YP) / _polevl(z, _Y1_YQ)) + _TWO_OVER_PI * (_j1(safe) * jnp.log(safe) - 1 / safe)
    small = jnp.where(x == 0, -jnp.inf, jnp.where(x < 0, jnp.nan, small))
    return jnp.where(x <= 5, small, _bessel_asymptotic(x, _J1_PP, _J1_PQ, _J1_QP, _J1_QQ, _3PI_4, True))


def _k(x, order, scaled):
    """K0 / K1 (optionally times exp(x)): Chebyshev series on (0, 2] and (2, inf)."""
    small_x = jnp.where((x > 0) & (x <= 2), x, 1.0)
    big_x = jnp.where(x > 2, x, 4.0)
    if order == 0:
        small = _chbevl(small_x * small_x - 2, _K0_A) - jnp.log(0.5 * small_x) * jss.i0(small_x)
        big = _chbevl(8.0 / big_x - 2, _K0_B) / jnp.sqrt(big_x)
    else:
        small = jnp.log(0.5 * small_x) * jss.i1(small_x) + _chbevl(small_x * small_x - 2, _K1_A) / small_x
        big = _chbevl(8.0 / big_x - 2, _K1_B) / jnp.sqrt(big_x)
    if scaled:
        small = small * jnp.exp(small_x)
    else:
        big = big * jnp.exp(-big_x)
    out = jnp.where(x <= 2, small, big)
    out = jnp.where(x == 0, jnp.inf, out)
    return jnp.where(x < 0, jnp.nan, out)


def _k_lowering(name, order, scaled):
    """The lowering of torch.special's `name`: K_order of the input as float (scaled: times exp(x))."""
    def lowering(self):
        return _k(as_float(self), order, scaled)

    lowering.__name__ = lowering.__qualname__ = name
    return lowering


modified_bessel_k0 = lower(aten.special_modified_bessel_k0)(_k_lowering("modified_bessel_k0", 0, False))
modified_bessel_k1 = lower(aten.special_modified_bessel_k1)(_k_lowering("modified_bessel_k1", 1, False))
scaled_modified_bessel_k0 = lower(aten.special_scaled_modified_bessel_k0)(
    _k_lowering("scaled_modified_bessel_k0", 0, True))
scaled_modified_bessel_k1 = lower(aten.special_scaled_modified_bessel_k1)(
    _k_lowering("scaled_modified_bessel_k1", 1, True))


@lower(aten.special_airy_ai)
def airy_ai(self):
    x = as_float(self)
    # x < -2.09: the oscillating asymptotic form.
    neg = jnp.where(x < -2.09, x, -4.0)
    zeta_neg = -2.0 * neg * jnp.sqrt(-neg) / 3.0
    z = 1.0 / zeta_neg
    zz = z * z
    f = 1.0 + zz * _polevl(zz, _AIRY_AFN) / _polevl(zz, _AIRY_AFD)
    g = z * _polevl(zz, _AIRY_AGN) / _polevl(zz, _AIRY_AGD)
    t = zeta_neg + 0.25 * jnp.pi
    left = 5.64189583547756286948e-01 / jnp.sqrt(jnp.sqrt(-neg)) * (jnp.sin(t) * f - jnp.cos(t) * g)
    # x >= 2.09: the decaying asymptotic form.
    pos = jnp.where(x >= 2.09, x, 4.0)
    zeta = 2.0 * pos * jnp.sqrt(pos) / 3.0
    right = 5.64189583547756286948e-01 * (_polevl(1 / zeta, _AIRY_AN) / _polevl(1 / zeta, _AIRY_AD)) / (
        2.0 * jnp.sqrt(jnp.sqrt(pos)) * jnp.exp(zeta))
    # In between: the Maclaurin series f(x), g(x), summed until the terms vanish.
    xs = jnp.where((x >= -2.09) & (x < 2.09), x, 0.0)
    cube = xs * xs * xs
    f, g, m, n, k = jnp.ones_like(xs), xs, jnp.ones_like(xs), xs, jnp.ones_like(xs)
    done = jnp.zeros(xs.shape, bool)
    for _ in range(40):
        m2 = m * cube
        k2 = k + 1
        m2 = m2 / k2
        n2 = n * cube
        k2 = k2 + 1
        n2 = n2 / k2
        m2 = m2 / k2
        f2 = f + m2
        k2 = k2 + 1
        n2 = n2 / k2
        g2 = g + n2
        f, g = jnp.where(done, f, f2), jnp.where(done, g, g2)
        m, n, k = jnp.where(done, m, m2), jnp.where(done, n, n2), jnp.where(done, k, k2)
        done = done | (jnp.abs(m / f) <= 1.11022302462515654042e-16)
    middle = 0.355028053887817239260 * f - 0.258819403792806798405 * g
    out = jnp.where(x < -2.09, left, jnp.where(x >= 2.09, right, middle))
    out = jnp.where(x > 103.892, 0.0, out)
    return jnp.where(jnp.isinf(x), jnp.nan, out)
