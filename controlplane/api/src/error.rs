use std::fmt;
use std::path::PathBuf;

/// Everything this crate can fail at: a resource that breaks a rule, or the CRD files on disk.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A spec (or status) breaks one or more rules; every problem found is listed.
    #[error("invalid {kind}: {problems}")]
    Invalid {
        kind: &'static str,
        problems: FieldErrors,
    },
    #[error("cannot render CRD {name}: {reason}")]
    Render { name: String, reason: String },
    /// A workstation credential that cannot be written (a short token, no randomness).
    #[error("workstation credential: {0}")]
    Credential(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// One broken rule, located like the apiserver does (`spec.forks[1].forkOf.name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

/// The problems of one resource, in the order they were found. Never empty inside an
/// [`Error::Invalid`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FieldErrors(pub Vec<FieldError>);

impl FieldErrors {
    pub fn iter(&self) -> impl Iterator<Item = &FieldError> {
        self.0.iter()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for FieldErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl Error {
    /// The individual problems, when this is a validation error.
    pub fn field_errors(&self) -> &[FieldError] {
        match self {
            Error::Invalid { problems, .. } => &problems.0,
            _ => &[],
        }
    }
}
