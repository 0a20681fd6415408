//! Kubernetes name syntax: DNS labels, label keys and values (the API server's own rules), for
//! checking selectors before they are sent.

pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Kubernetes label name part: up to 63 characters, alphanumeric at both ends, `-_.` inside.
pub fn is_label_name(s: &str) -> bool {
    let bytes = s.as_bytes();
    let alnum_ends = matches!((bytes.first(), bytes.last()), (Some(a), Some(b)) if a.is_ascii_alphanumeric() && b.is_ascii_alphanumeric());
    s.len() <= 63
        && alnum_ends
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// An optional DNS-subdomain prefix and `/`, then a name.
pub fn is_label_key(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => {
            !prefix.is_empty()
                && prefix.len() <= 253
                && prefix.split('.').all(is_dns_label)
                && is_label_name(name)
        }
        None => is_label_name(s),
    }
}

/// Empty, or a label name.
pub fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_label_name(s)
}
