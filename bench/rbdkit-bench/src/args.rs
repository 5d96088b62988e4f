//! A minimal `--key value` command-line parser (no dependency needed for
//! a handful of options).

use std::collections::HashMap;
use std::str::FromStr;

use crate::BoxError;

/// Parsed `--key value` options.
#[derive(Debug, Default)]
pub struct Args {
    values: HashMap<String, String>,
}

impl Args {
    /// Parses `--key value` pairs; anything else is a usage error.
    pub fn parse(argv: impl Iterator<Item = String>) -> Result<Args, BoxError> {
        let mut values = HashMap::new();
        let mut argv = argv;
        while let Some(flag) = argv.next() {
            let key = flag
                .strip_prefix("--")
                .ok_or_else(|| format!("expected --option, got {flag:?}"))?;
            let value = argv
                .next()
                .ok_or_else(|| format!("option --{key} needs a value"))?;
            values.insert(key.to_owned(), value);
        }
        Ok(Args { values })
    }

    /// The value of a required option.
    pub fn get(&self, key: &str) -> Result<&str, BoxError> {
        self.values
            .get(key)
            .map(String::as_str)
            .ok_or_else(|| format!("missing option --{key}").into())
    }

    /// The value of an option, or `default` when it is absent.
    pub fn get_or<'a>(&'a self, key: &str, default: &'a str) -> &'a str {
        self.values.get(key).map_or(default, String::as_str)
    }

    /// A required option parsed as a number (or any `FromStr` type).
    pub fn num<T: FromStr>(&self, key: &str) -> Result<T, BoxError> {
        let raw = self.get(key)?;
        raw.parse()
            .map_err(|_| format!("option --{key}: cannot parse {raw:?}").into())
    }
}
