//! `f64` maximum and minimum as a compare and a select, for the scorers' per-candidate loops.
//!
//! `f64::max` and `f64::min` ignore a NaN operand (IEEE maxNum). WebAssembly's `f64.max` and
//! `f64.min` propagate it instead, so on wasm32 the compiler turns every `f64::max`/`f64::min`
//! into a call to libm's `fmax`/`fmin`: under V8 those calls were 9 % of the pick's time
//! (`tools/wasm-prof`, 128 endpoints). [`max`] and [`min`] give the same results as the
//! standard ones (a NaN operand is ignored; two NaNs give NaN) with no call; only the sign of a
//! zero result may differ between `-0.0` and `+0.0`, which the standard ones leave unspecified
//! too.

/// `a.max(b)`: the larger, ignoring a NaN operand.
#[inline(always)]
pub fn max(a: f64, b: f64) -> f64 {
    if a < b || a.is_nan() {
        b
    } else {
        a
    }
}

/// `a.min(b)`: the smaller, ignoring a NaN operand.
#[inline(always)]
pub fn min(a: f64, b: f64) -> f64 {
    if b < a || a.is_nan() {
        b
    } else {
        a
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal as `f64::max`/`f64::min` are: the same value, or both NaN.
    fn same(x: f64, y: f64) -> bool {
        x == y || (x.is_nan() && y.is_nan())
    }

    #[test]
    fn agree_with_the_standard_library_on_every_class_of_operand() {
        let vals = [
            f64::NEG_INFINITY,
            f64::MIN,
            -1.5,
            -f64::MIN_POSITIVE,
            0.0,
            f64::MIN_POSITIVE,
            1.0,
            2.5,
            f64::MAX,
            f64::INFINITY,
            f64::NAN,
            -f64::NAN,
        ];
        for &a in &vals {
            for &b in &vals {
                assert!(same(max(a, b), a.max(b)), "max({a}, {b}) = {} not {}", max(a, b), a.max(b));
                assert!(same(min(a, b), a.min(b)), "min({a}, {b}) = {} not {}", min(a, b), a.min(b));
            }
        }
        // A NaN operand is ignored, whichever side it is on.
        assert_eq!(max(f64::NAN, 3.0), 3.0);
        assert_eq!(max(3.0, f64::NAN), 3.0);
        assert_eq!(min(f64::NAN, -3.0), -3.0);
        assert_eq!(min(-3.0, f64::NAN), -3.0);
        assert!(max(f64::NAN, f64::NAN).is_nan());
        // Zeros compare equal; either sign is a correct answer.
        assert_eq!(max(-0.0, 0.0), 0.0);
        assert_eq!(min(0.0, -0.0), 0.0);
    }

    #[test]
    fn folds_like_the_standard_library() {
        let xs = [3.0, f64::NAN, -2.0, 7.5, f64::INFINITY, 0.25];
        assert_eq!(xs.iter().copied().fold(f64::INFINITY, min), -2.0);
        assert_eq!(xs.iter().copied().fold(f64::NEG_INFINITY, max), f64::INFINITY);
        assert_eq!([f64::NAN].iter().copied().fold(f64::INFINITY, min), f64::INFINITY);
    }
}
