//! Plain left-aligned text tables, as `rgpu smi` and `rgpu sessions` print them.

/// Prints `head` and `rows`, each column as wide as its widest cell.
pub fn print<const N: usize>(head: [&str; N], rows: &[[String; N]]) {
    let head = head.map(String::from);
    let mut width = head.clone().map(|h| h.len());
    for r in rows {
        for (w, c) in width.iter_mut().zip(r) {
            *w = (*w).max(c.chars().count());
        }
    }
    for r in std::iter::once(&head).chain(rows) {
        let line: Vec<String> = r.iter().zip(width).map(|(c, w)| format!("{c:<w$}")).collect();
        println!("{}", line.join("  ").trim_end());
    }
}
