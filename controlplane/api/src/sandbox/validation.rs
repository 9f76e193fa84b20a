//! Sandbox validation: every rule of the schema and its CEL rules, repeated in Rust for
//! controllers and tests, plus what CEL cannot express (references between fields, patch
//! shapes, TTL range, duplicate ports, immutability).

use std::collections::{BTreeMap, BTreeSet, HashSet};

use super::*;
use crate::common::check_container;
use crate::error::Error;

impl Sandbox {
    /// [`SandboxSpec::validate`] plus the rule on the object's name.
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        check_owner_name(&mut c, self.metadata.name.as_deref());
        self.spec.check(&mut c);
        c.finish("Sandbox")
    }
}

/// Sandbox and route group names end up in label values and host names, so they must be DNS
/// labels rather than the subdomains Kubernetes allows.
pub(crate) fn check_owner_name(c: &mut Checker, name: Option<&str>) {
    if let Some(name) = name {
        c.dns_label(|| "metadata.name".into(), name);
    }
}

impl SandboxSpec {
    /// Every rule of the schema and its CEL rules, plus what they cannot express: references
    /// between fields (env from a resource or fork that exists), patch shapes, TTL range,
    /// duplicate ports. Immutability needs the old spec: see [`SandboxSpec::validate_update`].
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c);
        c.finish("Sandbox")
    }

    /// The rules that compare with the previous spec (the CEL transition rules).
    pub fn validate_update(&self, old: &SandboxSpec) -> Result<(), Error> {
        let mut c = Checker::default();
        if self.resources != old.resources {
            c.fail("spec.resources", "resources are immutable");
        }
        c.finish("Sandbox")
    }

    fn check(&self, c: &mut Checker) {
        if let Some(d) = &self.description {
            c.max_len(|| "spec.description".into(), d, DESCRIPTION_MAX);
        }
        check_labels(c, "spec.labels", &self.labels);

        if self.forks.is_empty() && self.local.is_empty() && self.virtual_workloads.is_empty() {
            c.fail(
                "spec",
                "a sandbox needs at least one fork, local or virtual workload",
            );
        }
        c.max_items(|| "spec.forks".into(), &self.forks, MAX_WORKLOADS);
        c.max_items(|| "spec.local".into(), &self.local, MAX_WORKLOADS);
        c.max_items(
            || "spec.virtual".into(),
            &self.virtual_workloads,
            MAX_WORKLOADS,
        );
        c.max_items(|| "spec.resources".into(), &self.resources, MAX_RESOURCES);
        if let Some(capture) = &self.capture {
            c.max_items(
                || "spec.capture.redactHeaders".into(),
                &capture.redact_headers,
                MAX_REDACT_HEADERS,
            );
            for (i, h) in capture.redact_headers.iter().enumerate() {
                c.require(
                    is_header_name(h),
                    || format!("spec.capture.redactHeaders[{i}]"),
                    "a lowercase HTTP header name of at most 64 characters",
                );
            }
        }

        // A baseline has one routing rule per key, so it may stand in one place only.
        let mut baselines: BTreeMap<&WorkloadRef, String> = BTreeMap::new();
        let refs = SandboxRefs {
            resources: self.resources.iter().map(|r| r.name.as_str()).collect(),
            forks: self.forks.iter().map(|f| &f.fork_of).collect(),
        };

        for (i, f) in self.forks.iter().enumerate() {
            let path = format!("spec.forks[{i}]");
            f.fork_of.check(c, &format!("{path}.forkOf"));
            claim_baseline(c, &mut baselines, &f.fork_of, format!("{path}.forkOf"));
            f.customizations
                .check(c, &format!("{path}.customizations"), Some(&refs));
        }

        let mut names = HashSet::new();
        for (i, l) in self.local.iter().enumerate() {
            let path = format!("spec.local[{i}]");
            c.dns_label(|| format!("{path}.name"), &l.name);
            if !names.insert(l.name.as_str()) {
                c.fail(
                    format!("{path}.name"),
                    format!("duplicate name {:?}", l.name),
                );
            }
            l.from.check(c, &format!("{path}.from"));
            claim_baseline(c, &mut baselines, &l.from, format!("{path}.from"));
            if l.mappings.is_empty() {
                c.fail(format!("{path}.mappings"), "must not be empty");
            }
            c.max_items(|| format!("{path}.mappings"), &l.mappings, MAX_WORKLOADS);
            let mut ports = HashSet::new();
            for (j, m) in l.mappings.iter().enumerate() {
                let mpath = format!("{path}.mappings[{j}]");
                check_port(c, || format!("{mpath}.port"), m.port);
                if !ports.insert(m.port) {
                    c.fail(
                        format!("{mpath}.port"),
                        format!("port {} is mapped twice", m.port),
                    );
                }
                c.require(
                    is_host_port(&m.to_local),
                    || format!("{mpath}.toLocal"),
                    "must be host:port (e.g. localhost:8080)",
                );
            }
            l.check_env_and_files(c, &path, &refs);
        }
        if !self.local.is_empty() && self.workstation.is_none() {
            c.fail("spec.workstation", "local workloads need spec.workstation");
        }
        if let Some(w) = &self.workstation {
            c.dns_label(|| "spec.workstation".into(), w);
        }

        let mut names = HashSet::new();
        for (i, v) in self.virtual_workloads.iter().enumerate() {
            let path = format!("spec.virtual[{i}]");
            c.dns_label(|| format!("{path}.name"), &v.name);
            if !names.insert(v.name.as_str()) {
                c.fail(
                    format!("{path}.name"),
                    format!("duplicate name {:?}", v.name),
                );
            }
            v.workload.check(c, &format!("{path}.workload"));
            claim_baseline(c, &mut baselines, &v.workload, format!("{path}.workload"));
        }

        let mut names = HashSet::new();
        for (i, r) in self.resources.iter().enumerate() {
            let path = format!("spec.resources[{i}]");
            c.dns_label(|| format!("{path}.name"), &r.name);
            if !names.insert(r.name.as_str()) {
                c.fail(
                    format!("{path}.name"),
                    format!("duplicate name {:?}", r.name),
                );
            }
            c.require(
                is_plugin(&r.plugin),
                || format!("{path}.plugin"),
                "must be a plugin name, optionally with @version",
            );
            if r.params.len() > MAX_PARAMS {
                c.fail(
                    format!("{path}.params"),
                    format!("at most {MAX_PARAMS} parameters"),
                );
            }
            for (k, v) in &r.params {
                c.max_len(|| format!("{path}.params[{k}]"), v, VALUE_MAX);
            }
        }

        if let Some(rg) = &self.default_route_group {
            check_endpoints(c, "spec.defaultRouteGroup.endpoints", &rg.endpoints);
        }
        if let Some(ttl) = &self.ttl {
            c.require(
                ttl.duration().is_some(),
                || "spec.ttl.duration".into(),
                "must be a positive whole number (at most 4294967295) followed by m, h, d or w",
            );
        }
    }
}

fn claim_baseline<'a>(
    c: &mut Checker,
    seen: &mut BTreeMap<&'a WorkloadRef, String>,
    r: &'a WorkloadRef,
    path: String,
) {
    if let Some(first) = seen.get(r) {
        c.fail(
            path,
            format!("baseline {r} is already used by {first}; a baseline may appear only once across forks, local and virtual"),
        );
    } else {
        seen.insert(r, path);
    }
}

/// What env `valueFrom` may refer to: the sandbox's resources and forks.
pub(crate) struct SandboxRefs<'a> {
    resources: HashSet<&'a str>,
    forks: HashSet<&'a WorkloadRef>,
}

impl Customizations {
    /// `refs` is `None` where the sandbox is not at hand (a ForkedWorkload); references are then
    /// not resolved.
    pub(crate) fn check(&self, c: &mut Checker, path: &str, refs: Option<&SandboxRefs<'_>>) {
        c.max_items(|| format!("{path}.images"), &self.images, MAX_IMAGES);
        let mut containers = HashSet::new();
        for (i, img) in self.images.iter().enumerate() {
            let ipath = format!("{path}.images[{i}]");
            c.require(
                is_image(&img.image),
                || format!("{ipath}.image"),
                "must be a non-empty image reference without whitespace",
            );
            if let Some(name) = &img.container {
                check_container(c, || format!("{ipath}.container"), name);
            }
            if !containers.insert(img.container.as_deref()) {
                c.fail(
                    format!("{ipath}.container"),
                    "at most one image per container (and at most one without container)",
                );
            }
        }

        c.max_items(|| format!("{path}.env"), &self.env, MAX_ENV);
        let mut vars = HashSet::new();
        for (i, e) in self.env.iter().enumerate() {
            let epath = format!("{path}.env[{i}]");
            e.check(c, &epath, refs);
            if !vars.insert((e.name.as_str(), e.container.as_deref())) {
                c.fail(
                    format!("{epath}.name"),
                    format!("{:?} is set twice for the same container", e.name),
                );
            }
        }

        if let Some(p) = &self.patch {
            p.check(c, &format!("{path}.patch"));
        }
    }
}

impl Local {
    /// `env` as a fork's, without `container` (the workstation runs one process) or
    /// `valueFrom.fork`; `files` with safe, distinct paths and one source each.
    fn check_env_and_files(&self, c: &mut Checker, path: &str, refs: &SandboxRefs<'_>) {
        if let Some(name) = &self.container {
            check_container(c, || format!("{path}.container"), name);
        }
        c.max_items(|| format!("{path}.env"), &self.env, MAX_ENV);
        let mut vars = HashSet::new();
        for (i, e) in self.env.iter().enumerate() {
            let epath = format!("{path}.env[{i}]");
            e.check(c, &epath, Some(refs));
            if e.container.is_some() {
                c.fail(
                    format!("{epath}.container"),
                    "a local workload has one process: set spec.local[].container instead",
                );
            }
            if e.value_from.as_ref().is_some_and(|v| v.fork.is_some()) {
                c.fail(
                    format!("{epath}.valueFrom.fork"),
                    "not supported for local workloads",
                );
            }
            if !vars.insert(e.name.as_str()) {
                c.fail(
                    format!("{epath}.name"),
                    format!("{:?} is set twice", e.name),
                );
            }
        }
        c.max_items(|| format!("{path}.files"), &self.files, MAX_ENV);
        let mut paths = HashSet::new();
        for (i, f) in self.files.iter().enumerate() {
            let fpath = format!("{path}.files[{i}]");
            c.require(
                is_file_path(&f.path),
                || format!("{fpath}.path"),
                "must be a file path of at most 1024 bytes without `..`, `.` or empty components",
            );
            if !paths.insert(f.path.trim_start_matches('/')) {
                c.fail(
                    format!("{fpath}.path"),
                    format!("{:?} is set twice", f.path),
                );
            }
            if let Some(v) = &f.value {
                c.max_len(|| format!("{fpath}.value"), v, VALUE_MAX);
            }
            match (&f.value, &f.value_from) {
                (Some(_), None) => {}
                (None, Some(from)) => {
                    // The same sources as an env value's, fork aside.
                    let as_env = EnvValueFrom {
                        config_map: from.config_map.clone(),
                        secret: from.secret.clone(),
                        resource: from.resource.clone(),
                        fork: None,
                    };
                    let set = usize::from(from.config_map.is_some())
                        + usize::from(from.secret.is_some())
                        + usize::from(from.resource.is_some());
                    if set == 1 {
                        as_env.check(c, &format!("{fpath}.valueFrom"), Some(refs));
                    } else {
                        c.fail(
                            format!("{fpath}.valueFrom"),
                            "exactly one of configMap, secret and resource",
                        );
                    }
                }
                _ => c.fail(fpath, "exactly one of value and valueFrom"),
            }
        }
    }
}

impl EnvOverride {
    fn check(&self, c: &mut Checker, path: &str, refs: Option<&SandboxRefs<'_>>) {
        c.require(
            is_env_name(&self.name),
            || format!("{path}.name"),
            "must be an environment variable name ([-._a-zA-Z][-._a-zA-Z0-9]*)",
        );
        if let Some(name) = &self.container {
            check_container(c, || format!("{path}.container"), name);
        }
        if let Some(v) = &self.value {
            c.max_len(|| format!("{path}.value"), v, VALUE_MAX);
        }
        match self.operation {
            EnvOperation::Delete => {
                if self.value.is_some() || self.value_from.is_some() {
                    c.fail(
                        path.to_owned(),
                        "operation delete takes neither value nor valueFrom",
                    );
                }
            }
            EnvOperation::Upsert => {
                if self.value.is_some() == self.value_from.is_some() {
                    c.fail(
                        path.to_owned(),
                        "operation upsert needs exactly one of value and valueFrom",
                    );
                }
            }
        }
        if let Some(from) = &self.value_from {
            from.check(c, &format!("{path}.valueFrom"), refs);
        }
    }
}

impl EnvValueFrom {
    fn check(&self, c: &mut Checker, path: &str, refs: Option<&SandboxRefs<'_>>) {
        let set = usize::from(self.config_map.is_some())
            + usize::from(self.secret.is_some())
            + usize::from(self.resource.is_some())
            + usize::from(self.fork.is_some());
        if set != 1 {
            c.fail(
                path.to_owned(),
                "exactly one of configMap, secret, resource and fork",
            );
        }
        for (field, r) in [("configMap", &self.config_map), ("secret", &self.secret)] {
            if let Some(r) = r {
                c.dns_subdomain(|| format!("{path}.{field}.name"), &r.name);
                let key_ok = !r.key.is_empty()
                    && r.key.len() <= DNS_SUBDOMAIN_MAX
                    && r.key
                        .bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'));
                c.require(
                    key_ok,
                    || format!("{path}.{field}.key"),
                    "must be a ConfigMap/Secret key ([-._a-zA-Z0-9]+)",
                );
            }
        }
        if let Some(r) = &self.resource {
            c.dns_label(|| format!("{path}.resource.name"), &r.name);
            if let Some(refs) = refs {
                c.require(
                    refs.resources.contains(r.name.as_str()),
                    || format!("{path}.resource.name"),
                    "must name one of spec.resources",
                );
            }
            let key_ok = !r.output_key.is_empty()
                && r.output_key.len() <= 253
                && r.output_key.split('.').all(|p| {
                    !p.is_empty()
                        && p.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_'))
                });
            c.require(
                key_ok,
                || format!("{path}.resource.outputKey"),
                "must be <step>.<output>",
            );
        }
        if let Some(f) = &self.fork {
            f.fork_of.check(c, &format!("{path}.fork.forkOf"));
            if let Some(refs) = refs {
                c.require(
                    refs.forks.contains(&f.fork_of),
                    || format!("{path}.fork.forkOf"),
                    "must be the forkOf of one of spec.forks",
                );
            }
            if let Err(e) = super::expression::parse(&f.expression) {
                c.fail(format!("{path}.fork.expression"), e);
            }
        }
    }
}

impl Patch {
    fn check(&self, c: &mut Checker, path: &str) {
        let vpath = || format!("{path}.value");
        match self.type_ {
            PatchType::Strategic | PatchType::Merge => c.require(
                self.value.is_object(),
                vpath,
                "a strategic or merge patch must be an object",
            ),
            PatchType::Json => match self.value.as_array() {
                Some(ops) => {
                    for (i, op) in ops.iter().enumerate() {
                        let name = op.get("op").and_then(|o| o.as_str());
                        let ok = matches!(
                            name,
                            Some("add" | "remove" | "replace" | "move" | "copy" | "test")
                        ) && op.get("path").is_some_and(|p| p.is_string());
                        c.require(
                            ok,
                            || format!("{path}.value[{i}]"),
                            "must be a JSON Patch operation with op (add, remove, replace, move, copy, test) and path",
                        );
                    }
                }
                None => c.fail(vpath(), "a json patch must be a list of operations"),
            },
        }
        let size = serde_json::to_vec(&self.value).map_or(usize::MAX, |v| v.len());
        if size > MAX_PATCH_BYTES {
            c.fail(
                vpath(),
                format!("must be at most {MAX_PATCH_BYTES} bytes as JSON"),
            );
        }
    }
}

pub(crate) fn check_labels(c: &mut Checker, path: &str, labels: &BTreeMap<String, String>) {
    if labels.len() > MAX_LABELS {
        c.fail(path.to_owned(), format!("at most {MAX_LABELS} labels"));
    }
    for (k, v) in labels {
        c.require(
            is_label_key(k),
            || format!("{path}[{k}]"),
            "keys must be Kubernetes label keys ([prefix/]name, name at most 63 characters)",
        );
        c.max_len(|| format!("{path}[{k}]"), v, FREE_LABEL_VALUE_MAX);
    }
}

pub(crate) fn check_endpoints(c: &mut Checker, path: &str, endpoints: &[Endpoint]) {
    c.max_items(|| path.to_owned(), endpoints, MAX_ENDPOINTS);
    let mut names = BTreeSet::new();
    for (i, e) in endpoints.iter().enumerate() {
        c.dns_label(|| format!("{path}[{i}].name"), &e.name);
        if !names.insert(e.name.as_str()) {
            c.fail(
                format!("{path}[{i}].name"),
                format!("duplicate name {:?}", e.name),
            );
        }
        c.require(
            is_endpoint_target(&e.target),
            || format!("{path}[{i}].target"),
            "must be scheme://host[:port] with scheme http, https, grpc or tcp",
        );
        if let Some(cluster) = &e.cluster {
            c.dns_label(|| format!("{path}[{i}].cluster"), cluster);
        }
    }
}

pub(crate) fn check_port(c: &mut Checker, path: impl FnOnce() -> String, port: i32) {
    c.require(
        (1..=65535).contains(&port),
        path,
        "must be a port number (1-65535)",
    );
}
