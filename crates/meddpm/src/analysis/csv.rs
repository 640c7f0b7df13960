//! Minimal RFC 4180 CSV reading and writing for the profile report.
//!
//! Nsight Compute's `--csv` exports quote every field, double embedded quotes, and on the details
//! page end metric rows with an unquoted empty field; quoted fields may hold commas (thousands
//! separators, `(8, 8, 1)` launch shapes) and, in principle, newlines. This reader handles all of
//! those; it needs no schema. The writer quotes only where needed.

/// Split CSV text into rows of fields. A trailing newline does not make an empty row; `\r\n` and
/// `\n` both end rows. An unterminated quote takes the rest of the text as that field.
pub fn parse(text: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut row = Vec::new();
    let mut field = String::new();
    let mut in_quotes = false;
    let mut chars = text.chars().peekable();
    let mut row_has_content = false;
    while let Some(c) = chars.next() {
        if in_quotes {
            if c == '"' {
                if chars.peek() == Some(&'"') {
                    field.push('"');
                    chars.next();
                } else {
                    in_quotes = false;
                }
            } else {
                field.push(c);
            }
            continue;
        }
        match c {
            '"' => {
                in_quotes = true;
                row_has_content = true;
            }
            ',' => {
                row.push(std::mem::take(&mut field));
                row_has_content = true;
            }
            '\r' if chars.peek() == Some(&'\n') => {}
            '\n' | '\r' => {
                if row_has_content || !field.is_empty() {
                    row.push(std::mem::take(&mut field));
                    rows.push(std::mem::take(&mut row));
                }
                row_has_content = false;
            }
            _ => {
                field.push(c);
                row_has_content = true;
            }
        }
    }
    if row_has_content || !field.is_empty() {
        row.push(field);
        rows.push(row);
    }
    rows
}

/// One CSV field, quoted when it holds a comma, quote or line break.
pub fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

/// One CSV line (with its newline) from fields.
pub fn line<S: AsRef<str>>(fields: &[S]) -> String {
    let mut s = fields.iter().map(|f| field(f.as_ref())).collect::<Vec<_>>().join(",");
    s.push('\n');
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoted_fields_commas_quotes_and_newlines() {
        let t = "\"a\",\"b, c\",\"say \"\"hi\"\"\",\r\n1,\"x\ny\",3\n\n";
        let r = parse(t);
        assert_eq!(r, vec![vec!["a", "b, c", "say \"hi\"", ""], vec!["1", "x\ny", "3"]]);
    }

    #[test]
    fn writer_round_trips_through_the_reader() {
        let fields = ["plain", "with,comma", "with \"quote\"", "two\nlines", ""];
        let r = parse(&line(&fields));
        assert_eq!(r, vec![fields.iter().map(|s| s.to_string()).collect::<Vec<_>>()]);
    }
}
