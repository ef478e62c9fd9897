//! Half-precision formats (f16, bf16) and rounding helpers.
//!
//! Arithmetic on the small formats is done in f64 and rounded once to the
//! target: f64 carries more than twice their significand bits plus two,
//! so the double rounding this implies is innocuous for +, -, *, /, sqrt
//! and fma (the classical result for IEEE formats).

/// (exponent bits, stored significand bits) of a small format.
pub const F16: (u32, u32) = (5, 10);
pub const BF16: (u32, u32) = (8, 7);

/// The OCP 8-bit formats (PTX `.e4m3`, `.e5m2`) as stored in a byte.
pub fn fp8_to_f64(v: u8, e5m2: bool) -> f64 {
    if e5m2 {
        // An IEEE-style format: the top byte of an f16.
        return small_to_f64(v as u32, (5, 2));
    }
    // e4m3 has no infinities: its top exponent is a normal binade but for the NaN S.1111.111.
    let sign = if v & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((v >> 3) & 0xf, v & 7);
    if e == 0xf && m == 7 {
        return f64::NAN;
    }
    if e == 0 {
        return sign * m as f64 * 2f64.powi(-9);
    }
    sign * (8 + m) as f64 * 2f64.powi(e as i32 - 10)
}

/// Rounds to the nearest 8-bit value (ties to even) with `.satfinite`, which PTX requires of
/// every conversion to these formats: beyond the largest finite value (and infinity) gives
/// that value, NaN gives the canonical NaN 0x7f.
pub fn f64_to_fp8_satfinite(x: f64, e5m2: bool) -> u8 {
    if x.is_nan() {
        return 0x7f;
    }
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    if e5m2 {
        let r = f64_to_small(x, (5, 2)) as u8;
        return if r & 0x7f == 0x7c { sign | 0x7b } else { r };
    }
    let a = x.abs();
    // 448 is e4m3's largest value; anything larger would round to 448 or to the NaN pattern.
    if a >= 448.0 {
        return sign | 0x7e;
    }
    let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    if a == 0.0 || e < -12 {
        return sign;
    }
    let mut q = e.max(-6) - 3;
    let mut m = (a * 2f64.powi(-q)).round_ties_even() as u32;
    if m >= 16 {
        m >>= 1;
        q += 1;
    }
    if m < 8 {
        return sign | m as u8;
    }
    sign | ((q + 10) as u8) << 3 | (m - 8) as u8
}

pub fn small_to_f64(bits: u32, (eb, mb): (u32, u32)) -> f64 {
    let sign = if bits >> (eb + mb) & 1 != 0 { -1.0 } else { 1.0 };
    let e = (bits >> mb) & ((1 << eb) - 1);
    let m = bits & ((1 << mb) - 1);
    let bias = (1i32 << (eb - 1)) - 1;
    if e == (1 << eb) - 1 {
        return if m == 0 { sign * f64::INFINITY } else { f64::NAN };
    }
    if e == 0 {
        return sign * m as f64 * 2f64.powi(1 - bias - mb as i32);
    }
    sign * (m as f64 + (1u64 << mb) as f64) * 2f64.powi(e as i32 - bias - mb as i32)
}

/// Rounds `x` to the nearest representable value of the small format (ties
/// to even); NaN becomes the canonical NaN PTX produces (all ones but the sign).
pub fn f64_to_small(x: f64, (eb, mb): (u32, u32)) -> u32 {
    let sign = u32::from(x.is_sign_negative()) << (eb + mb);
    let emax = (1u32 << eb) - 1;
    if x.is_nan() {
        return (1 << (eb + mb)) - 1;
    }
    let a = x.abs();
    if a.is_infinite() {
        return sign | emax << mb;
    }
    if a == 0.0 {
        return sign;
    }
    let bias = (1i32 << (eb - 1)) - 1;
    let e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    if e == -1023 {
        // An f64 subnormal is far below the smallest small-format subnormal.
        return sign;
    }
    let emin = 1 - bias;
    let q = e.max(emin) - mb as i32;
    let scaled = a * 2f64.powi(-q);
    let mut m = scaled.round_ties_even() as u64;
    let mut eq = q;
    if m >= 1 << (mb + 1) {
        m >>= 1;
        eq += 1;
    }
    if m < 1 << mb {
        return sign | m as u32;
    }
    let biased = eq + mb as i32 + bias;
    if biased >= emax as i32 {
        return sign | emax << mb;
    }
    sign | (biased as u32) << mb | (m as u32 & ((1 << mb) - 1))
}

pub fn next_up_f32(x: f32) -> f32 {
    if x.is_nan() || x == f32::INFINITY {
        return x;
    }
    if x == 0.0 {
        return f32::from_bits(1);
    }
    let b = x.to_bits();
    f32::from_bits(if x > 0.0 { b + 1 } else { b - 1 })
}

pub fn next_down_f32(x: f32) -> f32 {
    -next_up_f32(-x)
}

pub fn next_up_f64(x: f64) -> f64 {
    if x.is_nan() || x == f64::INFINITY {
        return x;
    }
    if x == 0.0 {
        return f64::from_bits(1);
    }
    let b = x.to_bits();
    f64::from_bits(if x > 0.0 { b + 1 } else { b - 1 })
}

pub fn next_down_f64(x: f64) -> f64 {
    -next_up_f64(-x)
}

/// Arithmetic under a directed rounding mode (`.rz`, `.rm`, `.rp`), which the host's FPU is not
/// switched to: each result is first rounded to nearest, then moved one step when the exact
/// value lies on the other side. The exact value is known as an unevaluated pair `hi + lo`
/// from error-free transformations (TwoSum; an fma for the error of a product, a quotient or
/// a square root), so the step is never taken on a guess.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Directed {
    /// Towards zero.
    Zero,
    /// Towards minus infinity.
    Down,
    /// Towards plus infinity.
    Up,
}

/// Exact `x + y` as `(s, e)`: `s` rounded to nearest, `e` the error (TwoSum).
fn two_sum(x: f64, y: f64) -> (f64, f64) {
    let s = x + y;
    let bb = s - x;
    (s, (x - (s - bb)) + (y - bb))
}

/// Whether the exact value `hi + lo` lies above / below the candidate `r` (already rounded
/// to nearest from it). `lo` only matters when `hi` is `r` itself; otherwise `hi` is off the
/// result type's grid by more than `|lo|` and alone says on which side the exact value is.
fn sides(r: f64, hi: f64, lo: f64, finite_inputs: bool) -> (bool, bool) {
    if r.is_infinite() && finite_inputs && !hi.is_nan() {
        // Overflowed to nearest infinity: the exact value is finite, inside it.
        return (r < 0.0, r > 0.0);
    }
    if r == hi {
        (lo > 0.0, lo < 0.0)
    } else {
        (hi > r, hi < r)
    }
}

fn step32(r: f32, above: bool, below: bool, mode: Directed) -> f32 {
    match mode {
        Directed::Down if below => next_down_f32(r),
        Directed::Up if above => next_up_f32(r),
        Directed::Zero if r > 0.0 && below => next_down_f32(r),
        Directed::Zero if r < 0.0 && above => next_up_f32(r),
        _ => r,
    }
}

fn step64(r: f64, above: bool, below: bool, mode: Directed) -> f64 {
    match mode {
        Directed::Down if below => next_down_f64(r),
        Directed::Up if above => next_up_f64(r),
        Directed::Zero if r > 0.0 && below => next_down_f64(r),
        Directed::Zero if r < 0.0 && above => next_up_f64(r),
        _ => r,
    }
}

/// Rounds the exact value `hi + lo` to f32 in `mode`.
fn round_pair32(hi: f64, lo: f64, finite_inputs: bool, mode: Directed) -> f32 {
    let r = hi as f32;
    if r.is_nan() {
        return r;
    }
    let (above, below) = sides(r as f64, hi, lo, finite_inputs);
    step32(r, above, below, mode)
}

pub fn add32(x: f32, y: f32, mode: Directed) -> f32 {
    let (s, e) = two_sum(x as f64, y as f64);
    round_pair32(s, e, x.is_finite() && y.is_finite(), mode)
}

pub fn mul32(x: f32, y: f32, mode: Directed) -> f32 {
    // 24 x 24 significant bits fit f64's 53: the product is exact.
    round_pair32(x as f64 * y as f64, 0.0, x.is_finite() && y.is_finite(), mode)
}

pub fn fma32(x: f32, y: f32, z: f32, mode: Directed) -> f32 {
    let (s, e) = two_sum(x as f64 * y as f64, z as f64);
    round_pair32(s, e, x.is_finite() && y.is_finite() && z.is_finite(), mode)
}

pub fn div32(x: f32, y: f32, mode: Directed) -> f32 {
    let (x, y) = (x as f64, y as f64);
    let q = x / y;
    // x - q*y exactly; its sign over y's is the sign of the quotient's error.
    let rem = (-q).mul_add(y, x);
    round_pair32(q, if rem == 0.0 || rem.is_nan() { 0.0 } else { rem / y }, x.is_finite() && y != 0.0, mode)
}

pub fn sqrt32(x: f32, mode: Directed) -> f32 {
    let x = x as f64;
    let s = x.sqrt();
    let rem = (-s).mul_add(s, x);
    round_pair32(s, if rem == 0.0 || rem.is_nan() { 0.0 } else { rem }, x.is_finite(), mode)
}

pub fn add64(x: f64, y: f64, mode: Directed) -> f64 {
    let (s, e) = two_sum(x, y);
    if s.is_nan() {
        return s;
    }
    let (above, below) = sides(s, s, e, x.is_finite() && y.is_finite());
    step64(s, above, below, mode)
}

pub fn mul64(x: f64, y: f64, mode: Directed) -> f64 {
    let p = x * y;
    if p.is_nan() {
        return p;
    }
    // The product's error is exact unless the product is subnormal.
    let e = x.mul_add(y, -p);
    let (above, below) = sides(p, p, e, x.is_finite() && y.is_finite());
    step64(p, above, below, mode)
}

/// Flush-to-zero for f32 (`.ftz`): subnormals become zero of the same sign.
#[inline]
pub fn ftz32(x: f32) -> f32 {
    if x.is_subnormal() {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_round_trips_and_rounds() {
        for (v, bits) in [(1.0, 0x3c00), (-2.0, 0xc000), (65504.0, 0x7bff), (2f64.powi(-14), 0x0400), (2f64.powi(-24), 0x0001), (0.0, 0)] {
            assert_eq!(f64_to_small(v, F16), bits, "{v}");
            assert_eq!(small_to_f64(bits, F16), v);
        }
        assert_eq!(f64_to_small(65520.0, F16), 0x7c00, "rounds to infinity");
        assert_eq!(f64_to_small(1.0 + 1.0 / 2048.0, F16), 0x3c00, "tie to even");
        assert_eq!(f64_to_small(1.0 + 3.0 / 2048.0, F16), 0x3c02, "tie to even (up)");
        assert_eq!(f64_to_small(f64::NAN, F16), 0x7fff);
    }

    #[test]
    fn bf16_matches_f32_top_half() {
        for v in [1.0f32, -3.5, 1e30, 1.2e-38, 0.1] {
            let b = f64_to_small(v as f64, BF16);
            let u = v.to_bits();
            let expect = (u + 0x7fff + ((u >> 16) & 1)) >> 16;
            assert_eq!(b, expect, "{v}");
        }
    }

    #[test]
    fn directed_rounding_brackets_the_exact_value() {
        use super::Directed::*;
        // 1 + 2^-30 is not an f32: down/zero give 1, up the next f32 above 1.
        let tiny = (2.0f32).powi(-30);
        assert_eq!(add32(1.0, tiny, Down), 1.0);
        assert_eq!(add32(1.0, tiny, Zero), 1.0);
        assert_eq!(add32(1.0, tiny, Up), next_up_f32(1.0));
        assert_eq!(add32(-1.0, -tiny, Zero), -1.0);
        assert_eq!(add32(-1.0, -tiny, Down), next_down_f32(-1.0));
        // A huge gap that f64 itself rounds away: the error still counts.
        assert_eq!(add32(1.0, 1e-30, Up), next_up_f32(1.0));
        // Exact results do not move.
        assert_eq!(add32(1.5, 0.25, Up), 1.75);
        assert_eq!(mul32(3.0, 0.5, Down), 1.5);
        // 1/3 lies between two f32s; round to nearest picks the upper one.
        let third = 1.0f32 / 3.0;
        assert!(third as f64 > 1.0 / 3.0);
        assert_eq!(div32(1.0, 3.0, Down), next_down_f32(third));
        assert_eq!(div32(1.0, 3.0, Up), third);
        assert_eq!(div32(-1.0, 3.0, Zero), -next_down_f32(third));
        assert_eq!(div32(-1.0, 3.0, Down), -third);
        assert!((sqrt32(2.0, Up) as f64) > 2f64.sqrt() && (sqrt32(2.0, Down) as f64) < 2f64.sqrt());
        assert_eq!(sqrt32(4.0, Up), 2.0);
        // fma: 1 + 2^-24 * 2^-24 rounds down to 1, up to the next.
        let e = (2.0f32).powi(-24);
        assert_eq!(fma32(e, e, 1.0, Zero), 1.0);
        assert_eq!(fma32(e, e, 1.0, Up), next_up_f32(1.0));
        // Overflow: towards zero stops at the largest finite value.
        assert_eq!(mul32(f32::MAX, 2.0, Zero), f32::MAX);
        assert_eq!(mul32(f32::MAX, 2.0, Up), f32::INFINITY);
        assert_eq!(mul32(f32::MAX, -2.0, Up), -f32::MAX);
        assert_eq!(add32(f32::INFINITY, 1.0, Zero), f32::INFINITY);
        assert!(add32(f32::INFINITY, f32::NEG_INFINITY, Up).is_nan());
        assert_eq!(div32(1.0, 0.0, Zero), f32::INFINITY);
        // Underflow to zero: up gives the smallest subnormal.
        assert_eq!(mul32(1e-30, 1e-30, Up), f32::from_bits(1));
        assert_eq!(mul32(1e-30, 1e-30, Zero), 0.0);
        // f64.
        let t = 2f64.powi(-60);
        assert_eq!(add64(1.0, t, Up), next_up_f64(1.0));
        assert_eq!(add64(1.0, t, Down), 1.0);
        // fl(1/3) < 1/3, so 3 * fl(1/3) is just below 1, which round to nearest gives.
        assert_eq!(mul64(1.0 / 3.0, 3.0, Up), 1.0);
        assert_eq!(mul64(1.0 / 3.0, 3.0, Down), next_down_f64(1.0));
        assert_eq!(mul64(f64::MAX, 2.0, Zero), f64::MAX);
    }
}
