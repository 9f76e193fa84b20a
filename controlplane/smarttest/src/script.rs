//! A script step: a command (k6, Playwright, a language's test runner) run once per pass instead
//! of a request, for what a script does better than a list of requests. Its exit status is the
//! answer's status and its standard output the answer's body, so the findings compare them as
//! they compare answers: a status that changed, a JSON field gone from its output, a line that
//! changed where the baseline's own two runs agreed. The types here are part of the spec (the
//! `SmartTest` resource); running it is `exec` (feature `run`).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Most arguments of a command, program included; longest argument.
pub const MAX_ARGS: usize = 64;
pub const MAX_ARG: usize = 4096;
/// A variable's name: its longest and its syntax.
pub const MAX_ENV_NAME: usize = 256;
pub const ENV_NAME_PATTERN: &str = "^[A-Za-z_][A-Za-z0-9_]*$";
/// Most environment variables a step adds; longest value.
pub const MAX_ENV: usize = 32;
pub const MAX_ENV_VALUE: usize = 4096;
/// The prefix of the variables the runner sets itself (and removes from what the script
/// inherits): a step may not set one.
pub const RESERVED_ENV_PREFIX: &str = "SPUR_";

/// A command run once per pass: twice for the baseline, once for the sandbox.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScriptStep {
    /// The program and its arguments, run without a shell (name `sh -c` to have one). The
    /// program is looked up on the runner's `PATH`: in automatic runs, the runner group's image
    /// must have it.
    #[schemars(length(min = 1, max = MAX_ARGS), inner(length(max = MAX_ARG)))]
    pub command: Vec<String>,
    /// Variables added to the environment the runner passes on. Stored in the test as written:
    /// no secrets (give those to the runner group's pods).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_ENV))]
    pub env: Vec<EnvEntry>,
}

/// An environment variable.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct EnvEntry {
    /// Letters, digits and `_`, not starting with a digit; not `SPUR_*` (the runner's).
    #[schemars(
        length(min = 1, max = MAX_ENV_NAME),
        regex(pattern = ENV_NAME_PATTERN),
        extend("x-kubernetes-validations" = [{
            "rule": "!self.startsWith('SPUR_')",
            "message": "names starting with SPUR_ are the runner's"
        }])
    )]
    pub name: String,
    #[schemars(length(max = MAX_ENV_VALUE))]
    pub value: String,
}

/// A script step ready to run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PreparedScript {
    pub program: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
}

impl ScriptStep {
    pub(crate) fn prepare(&self) -> Result<PreparedScript, String> {
        let Some((program, args)) = self.command.split_first() else {
            return Err("script.command: name the program to run".into());
        };
        if program.is_empty() {
            return Err("script.command[0]: the program's name is empty".into());
        }
        if self.command.len() > MAX_ARGS {
            return Err(format!(
                "script.command: {} arguments, at most {MAX_ARGS}",
                self.command.len()
            ));
        }
        for (i, arg) in self.command.iter().enumerate() {
            if arg.len() > MAX_ARG {
                return Err(format!(
                    "script.command[{i}]: {} bytes, at most {MAX_ARG}",
                    arg.len()
                ));
            }
            // A program cannot be given one: the operating system ends the argument there.
            if arg.contains('\0') {
                return Err(format!("script.command[{i}]: holds a NUL character"));
            }
        }
        if self.env.len() > MAX_ENV {
            return Err(format!(
                "script.env: {} variables, at most {MAX_ENV}",
                self.env.len()
            ));
        }
        let mut env = Vec::with_capacity(self.env.len());
        for (i, e) in self.env.iter().enumerate() {
            let name = &e.name;
            let valid = name
                .bytes()
                .next()
                .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
                && name.len() <= MAX_ENV_NAME
                && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
            if !valid {
                return Err(format!(
                    "script.env[{i}].name {name:?}: letters, digits and _, not starting with a digit"
                ));
            }
            if name.starts_with(RESERVED_ENV_PREFIX) {
                return Err(format!(
                    "script.env[{i}].name {name}: names starting with {RESERVED_ENV_PREFIX} are the runner's (SPUR_ROUTING_KEY, SPUR_BAGGAGE, SPUR_TEST_SIDE)"
                ));
            }
            if env.iter().any(|(n, _)| n == name) {
                return Err(format!("script.env[{i}].name {name}: set twice"));
            }
            if e.value.len() > MAX_ENV_VALUE || e.value.contains('\0') {
                return Err(format!(
                    "script.env[{i}].value: at most {MAX_ENV_VALUE} bytes, no NUL character"
                ));
            }
            env.push((name.clone(), e.value.clone()));
        }
        Ok(PreparedScript {
            program: program.clone(),
            args: args.to_vec(),
            env,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(command: &[&str], env: &[(&str, &str)]) -> ScriptStep {
        ScriptStep {
            command: command.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(n, v)| EnvEntry {
                    name: n.to_string(),
                    value: v.to_string(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_script_is_a_program_its_arguments_and_variables() {
        let p = step(&["k6", "run", "t.js"], &[("TARGET", "http://front:8080")])
            .prepare()
            .unwrap();
        assert_eq!(p.program, "k6");
        assert_eq!(p.args, ["run", "t.js"]);
        assert_eq!(
            p.env,
            [("TARGET".to_owned(), "http://front:8080".to_owned())]
        );

        let refused = |s: ScriptStep, what: &str| {
            let e = s.prepare().unwrap_err();
            assert!(e.contains(what), "{e}");
        };
        refused(step(&[], &[]), "name the program");
        refused(step(&[""], &[]), "empty");
        refused(step(&["sh", "-c", "a\0b"], &[]), "command[2]: holds a NUL");
        refused(step(&["k6"], &[("SPUR_ROUTING_KEY", "x")]), "the runner's");
        refused(step(&["k6"], &[("1X", "x")]), "not starting with a digit");
        refused(step(&["k6"], &[("A", "1"), ("A", "2")]), "set twice");
        refused(step(&["k6"], &[("A", "\0")]), "no NUL");
        let long = "x".repeat(MAX_ARG + 1);
        refused(step(&["k6", &long], &[]), "command[1]: 4097 bytes");
        let many: Vec<&str> = std::iter::repeat_n("a", MAX_ARGS + 1).collect();
        refused(step(&many, &[]), "65 arguments");
    }
}
