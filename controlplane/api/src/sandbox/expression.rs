//! `valueFrom.fork.expression`: the template that turns another fork of the sandbox into an
//! environment value, e.g. `http://{{.Service.Host}}:{{.Service.Port}}`. It is Signadot's
//! syntax (a Go template over the fork) restricted to the fields a fork has, so specs written
//! for Signadot keep working; anything else fails the Sandbox's validation with the fields it may
//! use.

/// What an expression may refer to, as written between `{{` and `}}` (spaces allowed inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForkField {
    /// `.Service.Host`: the host name of the fork's sandbox Service (`<name>.<namespace>.svc`).
    ServiceHost,
    /// `.Service.Port`: that Service's first port.
    ServicePort,
}

impl ForkField {
    const ALL: [(&'static str, ForkField); 2] = [
        (".Service.Host", ForkField::ServiceHost),
        (".Service.Port", ForkField::ServicePort),
    ];
}

/// One piece of a parsed expression.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part<'a> {
    Text(&'a str),
    Field(ForkField),
}

/// Longest expression (the CRD schema's bound).
pub const EXPRESSION_MAX: usize = 1024;

/// Splits `expr` into text and fields, as Go's text/template reads it: `{{- ` and ` -}}` trim
/// the white space next to them, `{{/* … */}}` is a comment, and `}}` outside an action is text.
/// The error says what is wrong and what is allowed.
pub fn parse(expr: &str) -> Result<Vec<Part<'_>>, String> {
    if expr.trim().is_empty() || expr.len() > EXPRESSION_MAX {
        return Err(format!(
            "must be a non-empty template of at most {EXPRESSION_MAX} bytes"
        ));
    }
    let mut parts = Vec::new();
    let mut rest = expr;
    // Set by a ` -}}`: the next text loses its leading white space.
    let mut trim_next = false;
    while let Some(open) = rest.find("{{") {
        let after = &rest[open + 2..];
        let close = after
            .find("}}")
            .ok_or_else(|| "has a {{ without its }}".to_string())?;
        let mut inner = &after[..close];
        let mut text = &rest[..open];
        if trim_next {
            text = text.trim_start();
        }
        if let Some(i) = inner.strip_prefix("- ") {
            text = text.trim_end();
            inner = i;
        }
        trim_next = false;
        if let Some(i) = inner.strip_suffix(" -") {
            trim_next = true;
            inner = i;
        }
        if !text.is_empty() {
            parts.push(Part::Text(text));
        }
        let inner = inner.trim();
        if !(inner.starts_with("/*") && inner.ends_with("*/") && inner.len() >= 4) {
            let field = ForkField::ALL
                .iter()
                .find(|(name, _)| *name == inner)
                .map(|(_, f)| *f)
                .ok_or_else(|| {
                    format!(
                        "refers to {{{{{inner}}}}}; a fork expression may use only {{{{.Service.Host}}}} and {{{{.Service.Port}}}}"
                    )
                })?;
            parts.push(Part::Field(field));
        }
        rest = &after[close + 2..];
    }
    let text = if trim_next { rest.trim_start() } else { rest };
    if !text.is_empty() {
        parts.push(Part::Text(text));
    }
    Ok(parts)
}

/// The value of `expr` for a fork whose sandbox Service is `host` with first port `port`.
pub fn render(expr: &str, host: &str, port: i32) -> Result<String, String> {
    let mut out = String::new();
    for part in parse(expr)? {
        match part {
            Part::Text(t) => out.push_str(t),
            Part::Field(ForkField::ServiceHost) => out.push_str(host),
            Part::Field(ForkField::ServicePort) => out.push_str(&port.to_string()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn renders_signadot_expressions() {
        let r = |e| render(e, "sb-route.hotrod.svc", 8083);
        assert_eq!(
            r("{{.Service.Host}}:{{.Service.Port}}").unwrap(),
            "sb-route.hotrod.svc:8083"
        );
        assert_eq!(
            r("http://{{ .Service.Host }}:{{ .Service.Port }}/api").unwrap(),
            "http://sb-route.hotrod.svc:8083/api"
        );
        assert_eq!(r("literal").unwrap(), "literal");
        // Go's trim markers and comments; `}}` in text is text.
        assert_eq!(
            r("host = {{- .Service.Host -}} ;{{/* the port */}} x}}").unwrap(),
            "host =sb-route.hotrod.svc; x}}"
        );
        assert_eq!(r("{{.Service.Port -}}  \n/x").unwrap(), "8083/x");
    }

    #[test]
    fn refuses_what_it_cannot_render() {
        for (e, want) in [
            ("{{.Deployment.Name}}", "may use only"),
            ("{{.Service.Host", "without its }}"),
            ("{{-.Service.Host}}", "may use only"),
            ("{{printf \"%s\" .Service.Host}}", "may use only"),
            ("   ", "non-empty"),
        ] {
            let err = parse(e).unwrap_err();
            assert!(err.contains(want), "{e}: {err}");
        }
        assert!(parse(&"a".repeat(EXPRESSION_MAX + 1)).is_err());
    }
}
