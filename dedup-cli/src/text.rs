//! Durations read and written as an operator types them, counts with separators, tables
//! in columns, a progress bar, payload previews, and HTML escaping.

use std::fmt::Write as _;
use std::io::Write;
use std::time::{Duration, Instant};

/// `7d`, `36h`, `1d12h`, `90s`, `250ms`, `0s`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let invalid = || format!("`{text}` is not a duration such as 7d, 36h, 1d12h, 90s or 250ms");
    let mut total = Duration::ZERO;
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(invalid());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(invalid)?;
        let number: u64 = rest[..digits].parse().map_err(|_| invalid())?;
        let unit_len = rest[digits..]
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len() - digits);
        let unit = match &rest[digits..digits + unit_len] {
            "w" => Duration::from_secs(7 * 24 * 3600),
            "d" => Duration::from_secs(24 * 3600),
            "h" => Duration::from_secs(3600),
            "m" => Duration::from_secs(60),
            "s" => Duration::from_secs(1),
            "ms" => Duration::from_millis(1),
            _ => return Err(invalid()),
        };
        let part = unit
            .checked_mul(u32::try_from(number).map_err(|_| invalid())?)
            .ok_or_else(invalid)?;
        total = total.checked_add(part).ok_or_else(invalid)?;
        rest = &rest[digits + unit_len..];
    }
    Ok(total)
}

/// `3d 4h`, `7d`, `12m 5s`, `850ms`: the largest unit, and the next one unless it is 0.
pub fn human(duration: Duration) -> String {
    let seconds = duration.as_secs();
    if seconds == 0 {
        return format!("{}ms", duration.as_millis());
    }
    let units = [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)];
    let Some(first) = units.iter().position(|(_, size)| seconds >= *size) else {
        return String::new();
    };
    let (name, size) = units[first];
    let mut out = format!("{}{name}", seconds / size);
    if let Some((next, next_size)) = units.get(first + 1) {
        let part = seconds % size / next_size;
        if part > 0 {
            let _ = write!(out, " {part}{next}");
        }
    }
    out
}

/// `1 id`, `2,000 ids`: a count and its noun, singular for 1.
pub fn count(n: u64, one: &str, many: &str) -> String {
    format!("{} {}", thousands(n), if n == 1 { one } else { many })
}

/// `1234567` → `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    out
}

/// Rows in aligned columns: the first column left-aligned, the others right-aligned
/// (numbers), every cell's control characters shown as `\u{…}` escapes so that stored text
/// cannot move the terminal's cursor.
pub fn table(out: &mut dyn Write, head: &[&str], rows: &[Vec<String>]) -> std::io::Result<()> {
    let cells: Vec<Vec<String>> = std::iter::once(head.iter().map(|h| (*h).to_owned()).collect())
        .chain(
            rows.iter()
                .map(|row| row.iter().map(|cell| terminal_safe(cell)).collect()),
        )
        .collect();
    let mut widths = vec![0; head.len()];
    for row in &cells {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    for row in &cells {
        let mut line = String::from(" ");
        for (i, cell) in row.iter().enumerate() {
            let pad = widths[i] - cell.chars().count();
            if i == 0 {
                let _ = write!(line, " {cell}{}", " ".repeat(pad));
            } else {
                let _ = write!(line, "  {}{cell}", " ".repeat(pad));
            }
        }
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// `text` with its control characters escaped (`\n` as `\u{a}`): safe on a terminal.
pub fn terminal_safe(text: &str) -> String {
    if !text.chars().any(char::is_control) {
        return text.to_owned();
    }
    text.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_unicode().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// A one-line progress bar on stderr, redrawn at most ten times a second.
pub struct Bar<'a> {
    total: u64,
    noun: (&'static str, &'static str),
    drawn: Option<Instant>,
    started: Instant,
    err: &'a mut dyn Write,
}

impl<'a> Bar<'a> {
    /// A bar towards `total` things called `noun` (singular, plural).
    pub fn new(total: u64, noun: (&'static str, &'static str), err: &'a mut dyn Write) -> Self {
        Bar {
            total,
            noun,
            drawn: None,
            started: Instant::now(),
            err,
        }
    }

    /// Draws `done` of the total, and `batches`; `finished` ends the line.
    pub fn draw(&mut self, done: u64, batches: u64, finished: bool) {
        if !finished
            && self
                .drawn
                .is_some_and(|at| at.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.drawn = Some(Instant::now());
        const WIDTH: u64 = 30;
        // The total is an estimate taken just before the work: never below what is done.
        let total = self.total.max(done).max(1);
        let filled = (done * WIDTH / total) as usize;
        let elapsed = self.started.elapsed().as_secs_f64();
        let rate = if elapsed > 0.0 {
            done as f64 / elapsed
        } else {
            0.0
        };
        let eta = if rate > 0.0 && !finished {
            let left = total.saturating_sub(done) as f64 / rate;
            format!("  eta {}", human(Duration::from_secs_f64(left)))
        } else {
            String::new()
        };
        let _ = write!(
            self.err,
            "\r[{}{}] {:>3}%  {}/{}  {}/s  {}{eta}\x1b[K",
            "#".repeat(filled),
            "-".repeat(WIDTH as usize - filled),
            done * 100 / total,
            thousands(done),
            count(total, self.noun.0, self.noun.1),
            thousands(rate as u64),
            count(batches, "batch", "batches"),
        );
        if finished {
            let _ = writeln!(self.err);
        }
        let _ = self.err.flush();
    }
}

/// How a payload is shown: JSON pretty-printed, UTF-8 text, or hexadecimal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Preview {
    /// Valid JSON, pretty-printed.
    Json(String),
    /// UTF-8 text that is not JSON.
    Text(String),
    /// Anything else: hexadecimal, 16 bytes a line.
    Hex(String),
}

impl Preview {
    /// The preview of at most `max` bytes of `payload`; whether it was cut.
    pub fn of(payload: &[u8], max: usize) -> (Preview, bool) {
        let cut = payload.len() > max;
        let shown = &payload[..payload.len().min(max)];
        if !cut
            && serde_json::from_slice::<serde::de::IgnoredAny>(shown).is_ok()
            && let Ok(text) = std::str::from_utf8(shown)
        {
            return (Preview::Json(pretty_json(text)), false);
        }
        // A cut may fall inside a character: keep the valid prefix.
        let text = match std::str::from_utf8(shown) {
            Ok(text) => Some(text),
            Err(error) if cut && error.error_len().is_none() => {
                std::str::from_utf8(&shown[..error.valid_up_to()]).ok()
            }
            Err(_) => None,
        };
        match text {
            Some(text)
                if !text
                    .chars()
                    .any(|c| c.is_control() && !matches!(c, '\n' | '\r' | '\t')) =>
            {
                (Preview::Text(text.to_owned()), cut)
            }
            _ => {
                let mut hex = String::new();
                for (i, line) in shown.chunks(16).enumerate() {
                    let _ = write!(hex, "{:08x} ", i * 16);
                    for byte in line {
                        let _ = write!(hex, " {byte:02x}");
                    }
                    hex.push('\n');
                }
                (Preview::Hex(hex), cut)
            }
        }
    }

    /// `json`, `text` or `hex`.
    pub fn kind(&self) -> &'static str {
        match self {
            Preview::Json(_) => "json",
            Preview::Text(_) => "text",
            Preview::Hex(_) => "hex",
        }
    }

    /// The text shown.
    pub fn text(&self) -> &str {
        match self {
            Preview::Json(text) | Preview::Text(text) | Preview::Hex(text) => text,
        }
    }
}

/// Valid JSON `text` re-indented by two spaces, its members in their order and its
/// strings byte for byte (a parse into a map would sort the keys).
fn pretty_json(text: &str) -> String {
    let mut out = String::with_capacity(text.len() * 2);
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = text.chars().peekable();
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.peek().is_some_and(|c| c.is_whitespace()) {
                    chars.next();
                }
                if chars.peek().is_some_and(|next| matches!(next, '}' | ']')) {
                    out.push(chars.next().expect("peeked"));
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}

/// `text` with `&`, `<`, `>`, `"` and `'` escaped: safe inside HTML text and quoted
/// attribute values. Every stored text the console shows goes through it.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("1d12h"), Ok(Duration::from_secs(36 * 3_600)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
        for bad in ["", "7", "d", "7x", "-1d", "1.5h", "99999999999w"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            human(Duration::from_secs(3 * 86_400 + 4 * 3_600 + 5)),
            "3d 4h"
        );
        assert_eq!(human(Duration::from_secs(65)), "1m 5s");
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(thousands(1_234_567), "1,234,567");
        assert_eq!(count(1, "id", "ids"), "1 id");
        assert_eq!(count(2_000, "batch", "batches"), "2,000 batches");
    }

    #[test]
    fn previews() {
        let (json, cut) = Preview::of(br#"{"z":[1, 2],"a":{}, "s":"x,\"{y}"}"#, 100);
        assert_eq!((json.kind(), cut), ("json", false));
        assert_eq!(
            json.text(),
            "{\n  \"z\": [\n    1,\n    2\n  ],\n  \"a\": {},\n  \"s\": \"x,\\\"{y}\"\n}",
            "members in their order, strings untouched"
        );
        assert_eq!(
            Preview::of(b"plain text", 100).0,
            Preview::Text("plain text".into())
        );
        let (hex, _) = Preview::of(&[0, 1, 0xff], 100);
        assert_eq!(hex.text(), "00000000  00 01 ff\n");
        // A cut inside a character keeps the valid prefix as text.
        let (text, cut) = Preview::of("héllo".as_bytes(), 2);
        assert_eq!((text, cut), (Preview::Text("h".into()), true));
    }

    #[test]
    fn escaping() {
        assert_eq!(
            escape(r#"<script>alert("x&y")</script>'"#),
            "&lt;script&gt;alert(&quot;x&amp;y&quot;)&lt;/script&gt;&#39;"
        );
        assert_eq!(terminal_safe("a\u{1b}[2Jb"), "a\\u{1b}[2Jb");
    }
}
