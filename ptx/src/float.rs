//! Half-precision formats (f16, bf16) and rounding helpers.
//!
//! Arithmetic on the small formats is done in f64 and rounded once to the
//! target: f64 carries more than twice their significand bits plus two,
//! so the double rounding this implies is innocuous for +, -, *, /, sqrt
//! and fma (the classical result for IEEE formats).

/// (exponent bits, stored significand bits) of a small format.
pub const F16: (u32, u32) = (5, 10);
pub const BF16: (u32, u32) = (8, 7);

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
}
