//! Metric label values shared by the components' metrics: backend URLs and model names without
//! copying, escaped as the exposition format requires.

use std::sync::Arc;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};

/// A label value shared without copying (backend URLs, model names, static strings).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct Label(pub Arc<str>);

impl EncodeLabelValue for Label {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> std::fmt::Result {
        write_escaped(encoder, &self.0)
    }
}

impl From<&str> for Label {
    fn from(s: &str) -> Self {
        Label(s.into())
    }
}

/// Writes a label value escaped as the exposition formats require (`\\`, `\"`, `\n`):
/// prometheus-client writes values as given, and one raw quote or newline from a client or a
/// backend would make the whole scrape invalid (or forge a line).
pub fn write_escaped(out: &mut impl std::fmt::Write, value: &str) -> std::fmt::Result {
    let mut rest = value;
    while let Some(i) = rest.find(['\\', '"', '\n']) {
        out.write_str(&rest[..i])?;
        out.write_str(match rest.as_bytes()[i] {
            b'\\' => "\\\\",
            b'"' => "\\\"",
            _ => "\\n",
        })?;
        rest = &rest[i + 1..];
    }
    out.write_str(rest)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BackendLabels {
    pub backend: Label,
}

/// The production-stack router labels its per-backend metrics `server`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ServerLabels {
    pub server: Label,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_values_are_escaped() {
        let mut out = String::new();
        write_escaped(&mut out, "a\"b\\c\nd").unwrap();
        assert_eq!(out, "a\\\"b\\\\c\\nd");
    }
}
