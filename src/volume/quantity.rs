//! Kubernetes resource quantities (`10Gi`, `500M`, `1.5Gi`, `1e9`) as byte
//! counts, and byte counts back to quantities.
//!
//! Only what storage needs: non-negative values, rounded up to whole bytes.

use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

/// One mebibyte: the unit the provisioner rounds volume sizes up to.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Why a quantity string could not be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuantityError {
    text: String,
    why: &'static str,
}

impl fmt::Display for QuantityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid quantity {:?}: {}", self.text, self.why)
    }
}

impl std::error::Error for QuantityError {}

/// Parses a quantity into a number of bytes, rounding a fractional result up.
///
/// Accepts the Kubernetes forms: a decimal number with an optional binary
/// suffix (`Ki` … `Ei`), decimal suffix (`n`, `u`, `m`, `k`, `M` … `E`) or
/// exponent (`e9`, `E3`). Negative values and values above `u64::MAX` fail.
pub fn parse_bytes(text: &str) -> Result<u64, QuantityError> {
    parse_exact(text).map(|(bytes, _)| bytes)
}

/// [`parse_bytes`], but a value that is not a whole number of bytes (such as
/// `1500m`) is an error instead of being rounded up: a storage request must
/// name a size, not a fraction of a byte.
pub fn parse_whole_bytes(text: &str) -> Result<u64, QuantityError> {
    match parse_exact(text)? {
        (bytes, true) => Ok(bytes),
        (_, false) => Err(QuantityError {
            text: text.to_owned(),
            why: "not a whole number of bytes",
        }),
    }
}

/// The value rounded up to whole bytes, and whether it was whole already.
fn parse_exact(text: &str) -> Result<(u64, bool), QuantityError> {
    let err = |why| QuantityError {
        text: text.to_owned(),
        why,
    };
    let s = text.trim();
    let s = s.strip_prefix('+').unwrap_or(s);
    if s.starts_with('-') {
        return Err(err("negative"));
    }
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    if number.is_empty() || number == "." {
        return Err(err("no number"));
    }
    let (int_part, frac_part) = match number.split_once('.') {
        Some((i, f)) => (i, f),
        None => (number, ""),
    };
    if frac_part.contains('.') {
        return Err(err("more than one decimal point"));
    }
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    if digits.len() > 30 {
        return Err(err("too many digits"));
    }
    let mantissa: u128 = if digits.is_empty() {
        0
    } else {
        digits.parse().map_err(|_| err("bad number"))?
    };
    // value = mantissa * base^exp / 10^frac_len
    let (base, exp): (u128, i32) = match suffix {
        "" => (10, 0),
        "Ki" => (2, 10),
        "Mi" => (2, 20),
        "Gi" => (2, 30),
        "Ti" => (2, 40),
        "Pi" => (2, 50),
        "Ei" => (2, 60),
        "n" => (10, -9),
        "u" => (10, -6),
        "m" => (10, -3),
        "k" => (10, 3),
        "M" => (10, 6),
        "G" => (10, 9),
        "T" => (10, 12),
        "P" => (10, 15),
        "E" => (10, 18),
        other => {
            let e = other
                .strip_prefix('e')
                .or_else(|| other.strip_prefix('E'))
                .ok_or_else(|| err("unknown suffix"))?;
            let e: i32 = e.parse().map_err(|_| err("bad exponent"))?;
            if !(-30..=30).contains(&e) {
                return Err(err("exponent out of range"));
            }
            (10, e)
        }
    };
    let frac_len = frac_part.len() as i32;
    let (mut num, mut den): (u128, u128) = (mantissa, 1);
    let pow = |b: u128, e: i32| -> Option<u128> { b.checked_pow(e as u32) };
    if base == 2 {
        num = num
            .checked_mul(1u128 << exp)
            .ok_or_else(|| err("too large"))?;
    } else if exp >= 0 {
        num = num
            .checked_mul(pow(10, exp).ok_or_else(|| err("too large"))?)
            .ok_or_else(|| err("too large"))?;
    } else {
        den = pow(10, -exp).ok_or_else(|| err("too small"))?;
    }
    den = den
        .checked_mul(pow(10, frac_len).ok_or_else(|| err("too many decimals"))?)
        .ok_or_else(|| err("too many decimals"))?;
    let bytes = num.div_ceil(den);
    let whole = num % den == 0;
    u64::try_from(bytes)
        .map(|b| (b, whole))
        .map_err(|_| err("too large"))
}

/// Parses a [`Quantity`] into bytes; see [`parse_bytes`].
pub fn quantity_bytes(q: &Quantity) -> Result<u64, QuantityError> {
    parse_bytes(&q.0)
}

/// Rounds a byte count up to a whole number of mebibytes.
pub fn round_up_mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB).saturating_mul(MIB)
}

/// The canonical quantity for a byte count: the largest binary suffix that
/// divides it exactly (`1Gi`, `1536Mi`, `4096`).
pub fn bytes_quantity(bytes: u64) -> Quantity {
    const UNITS: [(u32, &str); 6] = [
        (60, "Ei"),
        (50, "Pi"),
        (40, "Ti"),
        (30, "Gi"),
        (20, "Mi"),
        (10, "Ki"),
    ];
    if bytes != 0 {
        for (shift, unit) in UNITS {
            if bytes.trailing_zeros() >= shift {
                return Quantity(format!("{}{unit}", bytes >> shift));
            }
        }
    }
    Quantity(bytes.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_decimal_and_exponent_forms() {
        let cases = [
            ("0", 0),
            ("1", 1),
            ("1Ki", 1024),
            ("10Gi", 10 * GIB),
            ("1.5Gi", 3 * GIB / 2),
            ("1G", 1_000_000_000),
            ("500M", 500_000_000),
            ("1k", 1000),
            ("1e9", 1_000_000_000),
            ("2E3", 2000),
            ("100m", 1),
            ("1500m", 2),
            ("0.1", 1),
            ("+5Mi", 5 * MIB),
            ("1Ei", 1 << 60),
        ];
        for (text, want) in cases {
            assert_eq!(parse_bytes(text), Ok(want), "{text}");
        }
    }

    #[test]
    fn refuses_bad_quantities() {
        for text in [
            "", "-1Gi", "Gi", "1.2.3", "1Zi", "1gi", "20Ei", "1e99", ".", "1 Gi",
        ] {
            assert!(parse_bytes(text).is_err(), "{text:?} should fail");
        }
        let e = parse_bytes("3Xi").unwrap_err();
        assert_eq!(e.to_string(), "invalid quantity \"3Xi\": unknown suffix");
    }

    #[test]
    fn rounds_up_to_whole_mebibytes() {
        assert_eq!(round_up_mib(0), 0);
        assert_eq!(round_up_mib(1), MIB);
        assert_eq!(round_up_mib(MIB), MIB);
        assert_eq!(round_up_mib(MIB + 1), 2 * MIB);
        assert_eq!(round_up_mib(1_000_000_000), 954 * MIB);
    }

    #[test]
    fn formats_with_the_largest_exact_binary_unit() {
        assert_eq!(bytes_quantity(GIB).0, "1Gi");
        assert_eq!(bytes_quantity(1536 * MIB).0, "1536Mi");
        assert_eq!(bytes_quantity(4096).0, "4Ki");
        assert_eq!(bytes_quantity(1000).0, "1000");
        assert_eq!(bytes_quantity(0).0, "0");
        for b in [0, 1, MIB, 954 * MIB, 5 * GIB, 123_456_789] {
            assert_eq!(parse_bytes(&bytes_quantity(b).0), Ok(b));
        }
    }
}
