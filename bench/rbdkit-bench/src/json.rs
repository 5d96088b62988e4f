//! Just enough JSON output for flat result objects: strings, numbers and
//! arrays of numbers (no dependency needed).

use std::fmt::Write;

/// A JSON object being written, one member at a time.
#[derive(Debug)]
pub struct Object {
    buf: String,
    first: bool,
}

impl Default for Object {
    fn default() -> Self {
        Object::new()
    }
}

impl Object {
    /// An empty object.
    pub fn new() -> Object {
        Object {
            buf: String::from("{"),
            first: true,
        }
    }

    fn key(&mut self, key: &str) {
        if !self.first {
            self.buf.push(',');
        }
        self.first = false;
        push_str(&mut self.buf, key);
        self.buf.push(':');
    }

    /// Adds a string member.
    pub fn str(&mut self, key: &str, value: &str) {
        self.key(key);
        push_str(&mut self.buf, value);
    }

    /// Adds a number member (non-finite numbers become `null`).
    pub fn num(&mut self, key: &str, value: f64) {
        self.key(key);
        push_num(&mut self.buf, value);
    }

    /// Adds an array-of-numbers member.
    pub fn nums(&mut self, key: &str, values: &[f64]) {
        self.key(key);
        self.buf.push('[');
        for (i, v) in values.iter().enumerate() {
            if i > 0 {
                self.buf.push(',');
            }
            push_num(&mut self.buf, *v);
        }
        self.buf.push(']');
    }

    /// Adds a member whose value is another object.
    pub fn obj(&mut self, key: &str, value: Object) {
        self.key(key);
        self.buf.push_str(&value.finish());
    }

    /// The finished JSON text.
    pub fn finish(mut self) -> String {
        self.buf.push('}');
        self.buf
    }
}

fn push_num(buf: &mut String, v: f64) {
    if v.is_finite() {
        let _ = write!(buf, "{v}");
    } else {
        buf.push_str("null");
    }
}

fn push_str(buf: &mut String, s: &str) {
    buf.push('"');
    for c in s.chars() {
        match c {
            '"' => buf.push_str("\\\""),
            '\\' => buf.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(buf, "\\u{:04x}", c as u32);
            }
            c => buf.push(c),
        }
    }
    buf.push('"');
}
