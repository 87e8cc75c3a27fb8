//! Duration flags: a bare number of seconds, or humantime's units.

/// Parses a duration flag: a bare number is seconds (`1`, `0.5`), as in the production-stack
/// router's flags; otherwise humantime's units (`500ms`, `2s`, `1m 30s`).
pub fn parse(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    if let Ok(secs) = text.parse::<f64>() {
        return std::time::Duration::try_from_secs_f64(secs)
            .map_err(|_| format!("{text:?} is not a duration: seconds must be 0 or more"));
    }
    humantime::parse_duration(text).map_err(|e| {
        format!(
            "{text:?} is not a duration ({e}); use a number of seconds or units like 500ms, 2s, 1m"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::parse as duration;
    use std::time::Duration;

    #[test]
    fn durations_take_bare_seconds_and_units() {
        assert_eq!(duration("1"), Ok(Duration::from_secs(1)));
        assert_eq!(duration("0.25"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(duration("1m 30s"), Ok(Duration::from_secs(90)));
        assert!(duration("-1").is_err());
        assert!(duration("soon").unwrap_err().contains("number of seconds"));
    }
}
