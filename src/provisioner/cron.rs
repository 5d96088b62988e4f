//! Cron schedules as csi-addons reads them (robfig/cron's standard
//! parser): five fields (minute, hour, day of month, month, day of week;
//! `*`, lists, ranges, steps, month and day names, 7 for Sunday) or a
//! descriptor (`@yearly`, `@annually`, `@monthly`, `@weekly`, `@daily`,
//! `@midnight`, `@hourly`). When both day fields are restricted a day
//! matching either runs, as in cron. Times are UTC. Pure logic.

/// A parsed schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Schedule {
    minutes: u64,
    hours: u64,
    days: u64,
    months: u64,
    weekdays: u64,
    any_day: bool,
    any_weekday: bool,
}

const MONTHS: [&str; 12] = [
    "jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec",
];
const WEEKDAYS: [&str; 7] = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"];

fn field(text: &str, min: u32, max: u32, names: &[&str], what: &str) -> Result<u64, String> {
    let value = |s: &str| -> Result<u32, String> {
        let lower = s.to_ascii_lowercase();
        if let Some(i) = names.iter().position(|n| *n == lower) {
            return Ok(min + i as u32);
        }
        s.parse::<u32>()
            .map_err(|_| format!("{what} {s:?} is not a number"))
    };
    let mut bits = 0u64;
    for part in text.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                s.parse::<u32>()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| format!("{what} step {s:?} is not a positive number"))?,
            ),
            None => (part, 1),
        };
        let (lo, hi) = if range == "*" || range == "?" {
            (min, max)
        } else if let Some((a, b)) = range.split_once('-') {
            (value(a)?, value(b)?)
        } else {
            let v = value(range)?;
            // `5/15`: from 5 to the end, every 15.
            (v, if part.contains('/') { max } else { v })
        };
        if lo < min || hi > max || lo > hi {
            return Err(format!(
                "{what} {range:?} is outside {min}-{max} or backwards"
            ));
        }
        let mut v = lo;
        while v <= hi {
            bits |= 1 << v;
            match v.checked_add(step) {
                Some(n) => v = n,
                None => break,
            }
        }
    }
    Ok(bits)
}

impl Schedule {
    /// Parses a schedule; the error names the field and what is wrong.
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let t = text.trim();
        let expanded = match t.to_ascii_lowercase().as_str() {
            "@yearly" | "@annually" => "0 0 1 1 *".to_owned(),
            "@monthly" => "0 0 1 * *".to_owned(),
            "@weekly" => "0 0 * * 0".to_owned(),
            "@daily" | "@midnight" => "0 0 * * *".to_owned(),
            "@hourly" => "0 * * * *".to_owned(),
            d if d.starts_with('@') => return Err(format!("unknown descriptor {t:?}")),
            _ => t.to_owned(),
        };
        let f: Vec<&str> = expanded.split_whitespace().collect();
        if f.len() != 5 {
            return Err(format!(
                "{t:?} has {} fields; a schedule has five (minute hour day-of-month month day-of-week) or is a descriptor such as @weekly",
                f.len()
            ));
        }
        let mut weekdays = field(f[4], 0, 7, &WEEKDAYS, "day of week")?;
        if weekdays & (1 << 7) != 0 {
            weekdays = (weekdays | 1) & !(1 << 7);
        }
        Ok(Schedule {
            minutes: field(f[0], 0, 59, &[], "minute")?,
            hours: field(f[1], 0, 23, &[], "hour")?,
            days: field(f[2], 1, 31, &[], "day of month")?,
            months: field(f[3], 1, 12, &MONTHS, "month")?,
            weekdays,
            any_day: f[2].starts_with('*') || f[2] == "?",
            any_weekday: f[4].starts_with('*') || f[4] == "?",
        })
    }

    fn day_matches(&self, day: u32, weekday: u32) -> bool {
        let d = self.days & (1 << day) != 0;
        let w = self.weekdays & (1 << weekday) != 0;
        if self.any_day || self.any_weekday {
            d && w
        } else {
            d || w
        }
    }

    /// The first time (Unix seconds, UTC, on a whole minute) strictly after
    /// `after` that the schedule names; `None` if none in the next five
    /// years (`0 0 30 2 *`).
    pub fn next_after(&self, after: i64) -> Option<i64> {
        let mut t = after.div_euclid(60) * 60 + 60;
        let end = after + 5 * 366 * 86400;
        while t <= end {
            let days = t.div_euclid(86400);
            let (y, m, d) = civil_from_days(days);
            if self.months & (1 << m) == 0 {
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                t = days_from_civil(ny, nm, 1) * 86400;
                continue;
            }
            let weekday = (days + 4).rem_euclid(7) as u32;
            if !self.day_matches(d, weekday) {
                t = (days + 1) * 86400;
                continue;
            }
            let secs = t.rem_euclid(86400);
            let hour = (secs / 3600) as u32;
            if self.hours & (1 << hour) == 0 {
                t = days * 86400 + (i64::from(hour) + 1) * 3600;
                continue;
            }
            let minute = ((secs % 3600) / 60) as u32;
            if self.minutes & (1 << minute) == 0 {
                t += 60;
                continue;
            }
            return Some(t);
        }
        None
    }
}

/// (year, month 1-12, day 1-31) of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// The day count since 1970-01-01 of a civil date.
fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unix seconds of a UTC civil time.
    fn at(y: i64, mo: u32, d: u32, h: i64, mi: i64) -> i64 {
        days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60
    }

    #[test]
    fn civil_dates_round_trip() {
        for days in [-800_000i64, -1, 0, 59, 10_957, 20_000, 2_000_000] {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
        }
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(days_from_civil(2024, 2, 29)), (2024, 2, 29));
    }

    #[test]
    fn schedules_give_their_next_run() {
        // Friday 2026-12-04 22:31 UTC.
        let now = at(2026, 12, 4, 22, 31);
        let next = |s: &str| Schedule::parse(s).unwrap().next_after(now).unwrap();
        assert_eq!(next("@hourly"), at(2026, 12, 4, 23, 0));
        assert_eq!(next("@daily"), at(2026, 12, 5, 0, 0));
        assert_eq!(next("@weekly"), at(2026, 12, 6, 0, 0), "next Sunday");
        assert_eq!(next("@monthly"), at(2027, 1, 1, 0, 0));
        assert_eq!(next("@yearly"), at(2027, 1, 1, 0, 0));
        assert_eq!(next("*/5 * * * *"), at(2026, 12, 4, 22, 35));
        assert_eq!(next("* * * * *"), at(2026, 12, 4, 22, 32));
        assert_eq!(next("30 2 * * mon-fri"), at(2026, 12, 7, 2, 30));
        assert_eq!(next("0 0 29 feb *"), at(2028, 2, 29, 0, 0));
        assert_eq!(next("0 12 * * 7"), at(2026, 12, 6, 12, 0), "7 is Sunday");
        assert_eq!(next("5/20 3 * * *"), at(2026, 12, 5, 3, 5));
        // Both day fields: either.
        assert_eq!(next("0 0 13 * fri"), at(2026, 12, 11, 0, 0));
        assert_eq!(Schedule::parse("0 0 30 2 *").unwrap().next_after(now), None);
    }

    #[test]
    fn bad_schedules_are_refused_by_name() {
        for (s, why) in [
            ("* * * *", "has 4 fields"),
            ("60 * * * *", "minute"),
            ("* 24 * * *", "hour"),
            ("* * 0 * *", "day of month"),
            ("* * * 13 *", "month"),
            ("* * * * 8", "day of week"),
            ("*/0 * * * *", "step"),
            ("x * * * *", "not a number"),
            ("@fortnightly", "unknown descriptor"),
            ("5-1 * * * *", "backwards"),
        ] {
            let e = Schedule::parse(s).unwrap_err();
            assert!(e.contains(why), "{s}: {e}");
        }
    }
}
