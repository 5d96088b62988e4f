//! Image feature bits ([`Features`]) and their names as `rbd` spells them.

use std::fmt;
use std::ops::{BitOr, BitOrAssign};
use std::str::FromStr;

use rbd_sys as sys;

use crate::error::Error;

/// A set of RBD image feature bits (`RBD_FEATURE_*` in `rbd/features.h`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(u64);

/// Every named feature, with the name `rbd` and ceph-csi use for it.
const NAMES: &[(u64, &str)] = &[
    (sys::RBD_FEATURE_LAYERING as u64, "layering"),
    (sys::RBD_FEATURE_STRIPINGV2 as u64, "striping"),
    (sys::RBD_FEATURE_EXCLUSIVE_LOCK as u64, "exclusive-lock"),
    (sys::RBD_FEATURE_OBJECT_MAP as u64, "object-map"),
    (sys::RBD_FEATURE_FAST_DIFF as u64, "fast-diff"),
    (sys::RBD_FEATURE_DEEP_FLATTEN as u64, "deep-flatten"),
    (sys::RBD_FEATURE_JOURNALING as u64, "journaling"),
    (sys::RBD_FEATURE_DATA_POOL as u64, "data-pool"),
    (sys::RBD_FEATURE_OPERATIONS as u64, "operations"),
    (sys::RBD_FEATURE_MIGRATING as u64, "migrating"),
    (sys::RBD_FEATURE_NON_PRIMARY as u64, "non-primary"),
    (sys::RBD_FEATURE_DIRTY_CACHE as u64, "dirty-cache"),
];

impl Features {
    /// No features.
    pub const NONE: Features = Features(0);
    /// `layering`: clones.
    pub const LAYERING: Features = Features(sys::RBD_FEATURE_LAYERING as u64);
    /// `striping`: a stripe unit/count other than the object size.
    pub const STRIPING: Features = Features(sys::RBD_FEATURE_STRIPINGV2 as u64);
    /// `exclusive-lock`: one writer at a time.
    pub const EXCLUSIVE_LOCK: Features = Features(sys::RBD_FEATURE_EXCLUSIVE_LOCK as u64);
    /// `object-map`: tracks which objects exist; needs `exclusive-lock`.
    pub const OBJECT_MAP: Features = Features(sys::RBD_FEATURE_OBJECT_MAP as u64);
    /// `fast-diff`: fast diff and disk usage; needs `object-map`.
    pub const FAST_DIFF: Features = Features(sys::RBD_FEATURE_FAST_DIFF as u64);
    /// `deep-flatten`: flatten snapshots of clones too.
    pub const DEEP_FLATTEN: Features = Features(sys::RBD_FEATURE_DEEP_FLATTEN as u64);
    /// `journaling`: a journal for mirroring; needs `exclusive-lock`.
    pub const JOURNALING: Features = Features(sys::RBD_FEATURE_JOURNALING as u64);
    /// `data-pool`: data objects live in another pool.
    pub const DATA_POOL: Features = Features(sys::RBD_FEATURE_DATA_POOL as u64);
    /// librbd's default set (`RBD_FEATURES_DEFAULT`).
    pub const DEFAULT: Features = Features(sys::RBD_FEATURES_DEFAULT as u64);
    /// Features that can be turned on or off after creation.
    pub const MUTABLE: Features = Features(sys::RBD_FEATURES_MUTABLE as u64);

    /// From raw bits.
    pub const fn from_bits(bits: u64) -> Features {
        Features(bits)
    }

    /// The raw bits.
    pub const fn bits(self) -> u64 {
        self.0
    }

    /// True when every bit of `other` is set here.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// These features without those of `other`.
    pub const fn without(self, other: Features) -> Features {
        Features(self.0 & !other.0)
    }

    /// The names of the set bits, in bit order; unknown bits as `0x..`.
    pub fn names(self) -> Vec<String> {
        let mut out = Vec::new();
        let mut rest = self.0;
        for (bit, name) in NAMES {
            if self.0 & bit != 0 {
                out.push((*name).to_owned());
                rest &= !bit;
            }
        }
        if rest != 0 {
            out.push(format!("{rest:#x}"));
        }
        out
    }

    /// Checks the dependencies librbd enforces: `object-map` needs
    /// `exclusive-lock`, `fast-diff` needs `object-map`, `journaling` needs
    /// `exclusive-lock`. Returns a message that names the missing feature.
    pub fn check_dependencies(self) -> Result<(), String> {
        let rules = [
            (Features::OBJECT_MAP, Features::EXCLUSIVE_LOCK),
            (Features::FAST_DIFF, Features::OBJECT_MAP),
            (Features::JOURNALING, Features::EXCLUSIVE_LOCK),
        ];
        for (feature, needs) in rules {
            if self.contains(feature) && !self.contains(needs) {
                return Err(format!(
                    "feature {} needs {}",
                    feature.names().join(","),
                    needs.names().join(",")
                ));
            }
        }
        Ok(())
    }
}

impl BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl BitOrAssign for Features {
    fn bitor_assign(&mut self, rhs: Features) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({})", self.names().join(","))
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.names().join(","))
    }
}

impl FromStr for Features {
    type Err = Error;

    /// Parses a comma-separated list of names, such as
    /// `layering,exclusive-lock`. Whitespace around names is ignored; an
    /// empty string is no features.
    fn from_str(s: &str) -> Result<Features, Error> {
        let mut bits = 0u64;
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            let (bit, _) = NAMES.iter().find(|(_, n)| *n == name).ok_or_else(|| {
                let known: Vec<&str> = NAMES.iter().map(|(_, n)| *n).collect();
                Error::invalid(
                    "parse features",
                    name,
                    format!(
                        "unknown image feature {name:?}; known: {}",
                        known.join(", ")
                    ),
                )
            })?;
            bits |= bit;
        }
        Ok(Features(bits))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_names() {
        let f: Features = "layering, exclusive-lock,object-map".parse().unwrap();
        assert_eq!(
            f,
            Features::LAYERING | Features::EXCLUSIVE_LOCK | Features::OBJECT_MAP
        );
        assert_eq!(f.names(), vec!["layering", "exclusive-lock", "object-map"]);
        assert_eq!("".parse::<Features>().unwrap(), Features::NONE);
    }

    #[test]
    fn unknown_name_is_named_in_the_error() {
        let e = "layering,bogus".parse::<Features>().unwrap_err();
        assert!(e.to_string().contains("\"bogus\""), "{e}");
    }

    #[test]
    fn dependencies_are_checked() {
        assert!(Features::OBJECT_MAP
            .check_dependencies()
            .unwrap_err()
            .contains("exclusive-lock"));
        assert!((Features::FAST_DIFF | Features::EXCLUSIVE_LOCK)
            .check_dependencies()
            .unwrap_err()
            .contains("object-map"));
        assert!(Features::JOURNALING.check_dependencies().is_err());
        assert!(Features::DEFAULT.check_dependencies().is_ok());
    }
}
