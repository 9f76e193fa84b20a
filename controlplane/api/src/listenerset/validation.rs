//! ListenerSet validation: the schema's rules and its CEL rules repeated in Rust, plus what CEL
//! cannot express (unique names and ports, known clusters, bounds spur-l4 enforces).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::time::Duration;

use super::*;

/// Largest first-bytes window a hash key or key route may need: `spur_l4::MAX_FIRST_BYTES`,
/// written again here because this crate depends on no data-plane crate (the operator's tests
/// pin the two equal). A TCP listener buffers this much before it connects upstream.
pub const MAX_FIRST_BYTES: u32 = 16 * 1024;
/// Longest key of a key route and longest constant hash key, in bytes (spur-l4's bound).
pub const MAX_KEY_BYTES: usize = 1024;
/// Most sessions a cluster may allow per gateway pod (spur-l4's bound).
pub const MAX_SESSIONS: u32 = 1_000_000;
/// Longest HTTP health-check path (spur-l4's bound: it goes into the request line).
pub const MAX_HEALTH_PATH: usize = 2048;
/// Longest duration any field may have: far beyond any sensible timeout, and far from where
/// adding it to a clock could overflow.
pub const MAX_DURATION: Duration = Duration::from_secs(7 * 24 * 3600);
/// Longest Service port name (IANA service name), which listener names become.
pub const MAX_PORT_NAME: usize = 15;
/// Most selector endpoints in one set, all clusters together: each is a headless Service the
/// operator makes, and being allowed to write a ListenerSet must not mean making thousands.
pub const MAX_ENDPOINT_SERVICES: usize = 256;

impl Protocol {
    /// `tcp` or `udp`, as written in the spec.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl ListenerSet {
    /// [`ListenerSetSpec::validate`] with the object's own name.
    pub fn validate(&self) -> Result<(), Error> {
        self.spec
            .validate(self.metadata.name.as_deref().unwrap_or_default())
    }
}

impl ListenerSetSpec {
    /// Every rule of the schema, plus what it cannot say: unique names and ports, cluster
    /// references, exactly-one-of fields, selectors a Service can carry, durations, and the
    /// bounds `spur-l4` enforces (so what admission lets in, the gateways accept). One pass:
    /// every problem is reported with its path. `name` is the ListenerSet's (it names the
    /// client Service).
    pub fn validate(&self, name: &str) -> Result<(), Error> {
        let mut c = Checker::default();
        self.check(&mut c, name);
        c.finish("ListenerSet")
    }

    /// `spec.service.type`, defaulted.
    pub fn service_type(&self) -> ServiceType {
        self.service.as_ref().map(|s| s.type_).unwrap_or_default()
    }

    /// Whether the operator keeps a client Service for this set.
    pub fn makes_service(&self) -> bool {
        self.service_type() != ServiceType::None
    }

    /// Every cluster with its field path: the listeners' own, in order, then `spec.clusters`.
    pub fn all_clusters(&self) -> impl Iterator<Item = (String, &Cluster)> {
        let own = self
            .listeners
            .iter()
            .enumerate()
            .map(|(i, l)| (format!("spec.listeners[{i}].cluster"), &l.cluster));
        let extra = self
            .clusters
            .iter()
            .enumerate()
            .map(|(i, c)| (format!("spec.clusters[{i}]"), c));
        own.chain(extra)
    }

    /// The protocol sessions reach cluster `name` with: that of the first listener whose own
    /// cluster it is, else of the first listener whose key routes name it; `None` when no
    /// listener uses it.
    pub fn cluster_protocol(&self, name: &str) -> Option<Protocol> {
        self.listeners
            .iter()
            .find(|l| l.cluster.name == name)
            .or_else(|| {
                self.listeners.iter().find(|l| {
                    l.key_route
                        .as_ref()
                        .is_some_and(|k| k.routes.iter().any(|r| r.cluster == name))
                })
            })
            .map(|l| l.protocol)
    }

    fn check(&self, c: &mut Checker, name: &str) {
        let service = self.makes_service();
        if service {
            c.require(
                is_dns1035_label(name),
                || "metadata.name".into(),
                "must be a DNS-1035 label (1-63 of [a-z0-9-], starting with a letter, ending with a letter or digit) while spec.service.type is not None: it names the listeners' Service",
            );
        }
        check_selector(
            c,
            "spec.selector",
            &self.selector,
            service.then_some(
                "spec.service.type is not None, so it becomes the listeners' Service's selector",
            ),
        );

        c.require(
            !self.listeners.is_empty(),
            || "spec.listeners".into(),
            "must not be empty",
        );
        c.max_items(|| "spec.listeners".into(), &self.listeners, MAX_LISTENERS);
        c.max_items(|| "spec.clusters".into(), &self.clusters, MAX_LISTENERS);

        let mut names: HashMap<&str, usize> = HashMap::new();
        let mut ports: HashMap<(u16, &str), usize> = HashMap::new();
        for (i, l) in self.listeners.iter().enumerate() {
            let at = format!("spec.listeners[{i}]");
            c.dns_label(|| format!("{at}.name"), &l.name);
            if service && is_dns_label(&l.name) && !is_port_name(&l.name) {
                c.fail(
                    format!("{at}.name"),
                    format!("must be a valid Service port name while spec.service.type is not None (it names the listener's port): at most {MAX_PORT_NAME} characters, at least one letter, no \"--\""),
                );
            }
            match names.get(l.name.as_str()) {
                Some(j) => c.fail(
                    format!("{at}.name"),
                    format!(
                        "listener name {:?} is already used by spec.listeners[{j}]",
                        l.name
                    ),
                ),
                None => {
                    names.insert(&l.name, i);
                }
            }
            if l.port == 0 {
                c.fail(format!("{at}.port"), "must be between 1 and 65535");
            } else if let Some(j) = ports.get(&(l.port, l.protocol.as_str())) {
                c.fail(
                    format!("{at}.port"),
                    format!(
                        "{} port {} is already taken by spec.listeners[{j}] ({:?})",
                        l.protocol.as_str(),
                        l.port,
                        self.listeners[*j].name
                    ),
                );
            } else {
                ports.insert((l.port, l.protocol.as_str()), i);
            }
            if let Some(t) = &l.first_bytes_timeout {
                check_duration(c, format!("{at}.firstBytesTimeout"), t);
            }
            check_cluster(c, &format!("{at}.cluster"), &l.cluster, Some(l.protocol));
        }
        for (i, cl) in self.clusters.iter().enumerate() {
            check_cluster(c, &format!("spec.clusters[{i}]"), cl, None);
        }

        let mut clusters: HashMap<&str, String> = HashMap::new();
        for (at, cl) in self.all_clusters() {
            match clusters.get(cl.name.as_str()) {
                Some(first) => c.fail(
                    format!("{at}.name"),
                    format!(
                        "cluster name {:?} is already used by {first} (cluster names are unique in the set; a cluster two listeners share is written once, in spec.clusters, and named by key routes)",
                        cl.name
                    ),
                ),
                None => {
                    clusters.insert(&cl.name, at);
                }
            }
        }

        let selectors = self
            .all_clusters()
            .flat_map(|(_, cl)| &cl.endpoints)
            .filter(|e| e.selector.is_some())
            .count();
        if selectors > MAX_ENDPOINT_SERVICES {
            c.fail(
                "spec",
                format!("has {selectors} selector endpoints, at most {MAX_ENDPOINT_SERVICES} are allowed (each is a headless Service)"),
            );
        }

        for (i, l) in self.listeners.iter().enumerate() {
            if let Some(k) = &l.key_route {
                check_key_route(c, &format!("spec.listeners[{i}].keyRoute"), k, |n| {
                    clusters.contains_key(n)
                });
            }
        }
    }
}

/// A Service port name (IANA service name): at most 15 of `[a-z0-9-]`, at least one letter,
/// no leading, trailing or doubled `-`.
pub fn is_port_name(s: &str) -> bool {
    is_dns_label(s)
        && s.len() <= MAX_PORT_NAME
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.contains("--")
}

/// A label selector: valid keys and values, known operators. `service`: the selector becomes a
/// Service's (whose selector is a plain label map), so it must be non-empty `matchLabels`
/// only; the reason is said in the message.
fn check_selector(c: &mut Checker, path: &str, s: &LabelSelector, service: Option<&str>) {
    let labels = s.match_labels.as_ref();
    for (k, v) in labels.into_iter().flatten() {
        c.require(
            is_label_key(k),
            || format!("{path}.matchLabels[{k}]"),
            "the key must be a label key ([prefix/]name, name 1-63 of [A-Za-z0-9._-])",
        );
        c.require(
            is_label_value(v),
            || format!("{path}.matchLabels[{k}]"),
            "the value must be a label value (0-63 of [A-Za-z0-9._-], starting and ending with a letter or digit)",
        );
    }
    let exprs = s.match_expressions.as_deref().unwrap_or_default();
    if let Some(why) = service {
        if !exprs.is_empty() {
            c.fail(
                format!("{path}.matchExpressions"),
                format!("must be empty: {why}, and a Service selects by matchLabels only"),
            );
        }
        if labels.is_none_or(BTreeMap::is_empty) {
            c.fail(
                format!("{path}.matchLabels"),
                format!("must not be empty: {why}, and an empty one would select every pod of the namespace"),
            );
        }
        return;
    }
    for (i, e) in exprs.iter().enumerate() {
        let at = format!("{path}.matchExpressions[{i}]");
        c.require(
            is_label_key(&e.key),
            || format!("{at}.key"),
            "must be a label key ([prefix/]name, name 1-63 of [A-Za-z0-9._-])",
        );
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" | "NotIn" => c.require(
                !values.is_empty(),
                || format!("{at}.values"),
                "must not be empty for operator In or NotIn",
            ),
            "Exists" | "DoesNotExist" => c.require(
                values.is_empty(),
                || format!("{at}.values"),
                "must be empty for operator Exists or DoesNotExist",
            ),
            _ => c.fail(
                format!("{at}.operator"),
                "must be In, NotIn, Exists or DoesNotExist",
            ),
        }
        for (j, v) in values.iter().enumerate() {
            c.require(
                is_label_value(v),
                || format!("{at}.values[{j}]"),
                "must be a label value (0-63 of [A-Za-z0-9._-], starting and ending with a letter or digit)",
            );
        }
    }
}

/// One cluster; `protocol`: of the listener whose own cluster it is (`None`: `spec.clusters`).
fn check_cluster(c: &mut Checker, at: &str, cl: &Cluster, protocol: Option<Protocol>) {
    c.dns_label(|| format!("{at}.name"), &cl.name);
    c.require(
        !cl.endpoints.is_empty(),
        || format!("{at}.endpoints"),
        "must not be empty",
    );
    c.max_items(|| format!("{at}.endpoints"), &cl.endpoints, MAX_ENDPOINTS);
    // Two entries that resolve to the same endpoints would give it twice (spur-l4 refuses an
    // endpoint id or address used twice).
    let mut seen: HashMap<String, usize> = HashMap::new();
    for (j, e) in cl.endpoints.iter().enumerate() {
        let ep = format!("{at}.endpoints[{j}]");
        let set = usize::from(e.selector.is_some())
            + usize::from(e.address.is_some())
            + usize::from(e.dns_name.is_some());
        if set != 1 {
            c.fail(
                ep.clone(),
                "set exactly one of selector, address and dnsName",
            );
        }
        let what = if let Some(s) = &e.selector {
            check_selector(
                c,
                &format!("{ep}.selector"),
                s,
                Some(
                    "it becomes the selector of a headless Service whose EndpointSlices list the endpoint pods",
                ),
            );
            format!("selector {:?}", s.match_labels)
        } else if let Some(a) = &e.address {
            match a.parse::<IpAddr>() {
                Ok(ip) if ip.is_unspecified() => c.fail(
                    format!("{ep}.address"),
                    "must be a specific address, not 0.0.0.0 or ::",
                ),
                Ok(_) => {}
                Err(_) => c.fail(
                    format!("{ep}.address"),
                    "must be an IPv4 or IPv6 address (a name goes in dnsName)",
                ),
            }
            // Normalized, so `::1` and `0::1` are the same address.
            format!(
                "address {}",
                a.parse::<IpAddr>()
                    .map_or_else(|_| a.clone(), |ip| ip.to_string())
            )
        } else if let Some(d) = &e.dns_name {
            let d = d.strip_suffix('.').unwrap_or(d);
            if d.parse::<IpAddr>().is_ok() {
                c.fail(
                    format!("{ep}.dnsName"),
                    "is an IP address: write it in address",
                );
            } else {
                c.require(
                    is_host(d),
                    || format!("{ep}.dnsName"),
                    "must be a DNS name (dot-separated labels of [A-Za-z0-9-], at most 253 characters)",
                );
            }
            format!("dnsName {}", d.to_ascii_lowercase())
        } else {
            String::new()
        };
        if e.port == 0 {
            c.fail(format!("{ep}.port"), "must be between 1 and 65535");
        }
        if e.health_check_port == Some(0) {
            c.fail(
                format!("{ep}.healthCheckPort"),
                "must be between 1 and 65535",
            );
        }
        if protocol == Some(Protocol::Udp)
            && cl.health_check.is_some()
            && e.health_check_port.is_none()
        {
            c.fail(
                format!("{ep}.healthCheckPort"),
                "required: the cluster serves a UDP listener and has a health check, and health checks speak TCP or HTTP",
            );
        }
        if set == 1 {
            let key = format!("{what} port {}", e.port);
            match seen.get(&key) {
                Some(k) => c.fail(
                    ep,
                    format!(
                        "gives the same endpoints as endpoints[{k}] (the same {what}, port {})",
                        e.port
                    ),
                ),
                None => {
                    seen.insert(key, j);
                }
            }
        }
    }

    if let Some(h) = &cl.hash_key {
        let set = usize::from(h.constant.is_some())
            + usize::from(h.source_ip.is_some())
            + usize::from(h.source_ip_port.is_some())
            + usize::from(h.first_bytes.is_some());
        if set != 1 {
            c.fail(
                format!("{at}.hashKey"),
                "set exactly one of constant, sourceIp, sourceIpPort and firstBytes",
            );
        }
        if cl.lb == LbPolicy::RoundRobin {
            c.fail(
                format!("{at}.hashKey"),
                "needs lb ringHash or maglev (roundRobin hashes nothing)",
            );
        }
        if let Some(k) = &h.constant
            && (k.is_empty() || k.len() > MAX_KEY_BYTES)
        {
            c.fail(
                format!("{at}.hashKey.constant"),
                format!("must be 1 to {MAX_KEY_BYTES} bytes"),
            );
        }
        if let Some(r) = &h.first_bytes {
            if r.length == 0 {
                c.fail(
                    format!("{at}.hashKey.firstBytes.length"),
                    "must be at least 1",
                );
            }
            if u64::from(r.offset) + u64::from(r.length) > u64::from(MAX_FIRST_BYTES) {
                c.fail(
                    format!("{at}.hashKey.firstBytes"),
                    format!("offset + length must be at most {MAX_FIRST_BYTES} (a TCP listener buffers that much before it connects)"),
                );
            }
        }
    }

    if let Some(h) = &cl.health_check {
        let hc = format!("{at}.healthCheck");
        match (h.protocol, &h.path) {
            (HealthProtocol::Tcp, Some(_)) => {
                c.fail(format!("{hc}.path"), "is for protocol http only");
            }
            (HealthProtocol::Http, Some(p)) => c.require(
                p.starts_with('/')
                    && p.len() <= MAX_HEALTH_PATH
                    && !p.bytes().any(|b| b <= b' ' || b == 0x7f),
                || format!("{hc}.path"),
                "must start with '/', have no spaces or control characters and be at most 2048 bytes",
            ),
            _ => {}
        }
        let interval = h
            .interval
            .as_deref()
            .map_or(Some(Duration::from_secs(5)), |s| {
                check_duration(c, format!("{hc}.interval"), s)
            });
        let timeout = h
            .timeout
            .as_deref()
            .map_or(Some(Duration::from_secs(1)), |s| {
                check_duration(c, format!("{hc}.timeout"), s)
            });
        if let (Some(i), Some(t)) = (interval, timeout)
            && t > i
        {
            c.fail(
                format!("{hc}.timeout"),
                "must be at most interval (the checks of one endpoint never overlap; defaults: interval 5s, timeout 1s)",
            );
        }
        for (field, v) in [
            ("healthyThreshold", h.healthy_threshold),
            ("unhealthyThreshold", h.unhealthy_threshold),
        ] {
            c.require(
                v != Some(0),
                || format!("{hc}.{field}"),
                "must be at least 1",
            );
        }
    }
    if let Some(t) = &cl.idle_timeout {
        check_duration(c, format!("{at}.idleTimeout"), t);
    }
    if let Some(t) = &cl.connect_timeout {
        check_duration(c, format!("{at}.connectTimeout"), t);
    }
    if let Some(m) = cl.max_sessions
        && !(1..=MAX_SESSIONS).contains(&m)
    {
        c.fail(
            format!("{at}.maxSessions"),
            format!("must be between 1 and {MAX_SESSIONS}"),
        );
    }
}

fn check_key_route(c: &mut Checker, at: &str, k: &KeyRoute, known: impl Fn(&str) -> bool) {
    c.require(
        !k.routes.is_empty(),
        || format!("{at}.routes"),
        "must not be empty",
    );
    c.max_items(|| format!("{at}.routes"), &k.routes, MAX_KEY_ROUTES);
    if k.length == Some(0) {
        c.fail(format!("{at}.length"), "must be at least 1");
    }
    // The longest key a route can need: literal keys are known, a sandbox's is a routing key.
    let mut longest = 0usize;
    let mut keys: HashMap<Vec<u8>, usize> = HashMap::new();
    let mut sandboxes: HashMap<&str, usize> = HashMap::new();
    for (i, r) in k.routes.iter().enumerate() {
        let rt = format!("{at}.routes[{i}]");
        let set = usize::from(r.key.is_some())
            + usize::from(r.key_hex.is_some())
            + usize::from(r.sandbox.is_some());
        if set != 1 {
            c.fail(rt.clone(), "set exactly one of key, keyHex and sandbox");
        }
        let key = if let Some(s) = &r.key {
            Some((format!("{rt}.key"), s.as_bytes().to_vec()))
        } else if let Some(h) = &r.key_hex {
            match parse_hex(h) {
                Some(b) => Some((format!("{rt}.keyHex"), b)),
                None => {
                    c.fail(
                        format!("{rt}.keyHex"),
                        "must be an even number of hex digits ([0-9a-fA-F])",
                    );
                    None
                }
            }
        } else if let Some(s) = &r.sandbox {
            c.dns_label(|| format!("{rt}.sandbox"), s);
            match sandboxes.get(s.as_str()) {
                Some(j) => c.fail(
                    format!("{rt}.sandbox"),
                    format!("sandbox {s:?} is already routed by routes[{j}]"),
                ),
                None => {
                    sandboxes.insert(s, i);
                }
            }
            longest = longest.max(k.length.map_or(ROUTING_KEY_MAX, |l| l as usize));
            None
        } else {
            None
        };
        if let Some((path, key)) = key {
            if key.is_empty() || key.len() > MAX_KEY_BYTES {
                c.fail(path.clone(), format!("must be 1 to {MAX_KEY_BYTES} bytes"));
            }
            if let Some(len) = k.length
                && len != 0
                && key.len() != len as usize
            {
                c.fail(
                    path.clone(),
                    format!(
                        "is {} bytes, but length is {len} (with length, every key is exactly that long)",
                        key.len()
                    ),
                );
            }
            longest = longest.max(key.len());
            match keys.get(&key) {
                Some(j) => c.fail(path, format!("the same key as routes[{j}]")),
                None => {
                    keys.insert(key, i);
                }
            }
        }
        c.require(
            known(&r.cluster),
            || format!("{rt}.cluster"),
            "names no cluster of this set (a listener's cluster.name or spec.clusters[].name)",
        );
    }
    let needed = u64::from(k.offset) + k.length.map_or(longest as u64, u64::from);
    if needed > u64::from(MAX_FIRST_BYTES) {
        c.fail(
            at.to_owned(),
            format!("offset + key length must be at most {MAX_FIRST_BYTES} (a TCP listener buffers that much before it connects)"),
        );
    }
}

/// Checks a duration field; returns it when valid.
fn check_duration(c: &mut Checker, path: String, s: &str) -> Option<Duration> {
    match parse_duration(s) {
        Some(d) if d.is_zero() => c.fail(path, "must be greater than zero"),
        Some(d) if d > MAX_DURATION => c.fail(path, "must be at most 168h"),
        Some(d) => return Some(d),
        None => c.fail(
            path,
            format!("{s:?} is not a duration (a number with ms, s, m or h, e.g. 500ms, 5s, 2m)"),
        ),
    }
    None
}

/// The duration syntax the gateways read these fields with, `spur_runtime::parse_duration`'s
/// (`250ms`, `5s` or `5`, `2m`, `1h`); `None` when malformed.
pub fn parse_duration(s: &str) -> Option<Duration> {
    spur_runtime::parse_duration(s).ok()
}

/// Hex digits, two per byte; `None` for an odd count or a non-hex digit (the gateways' own
/// parser, `spur_runtime::parse_hex`).
pub use spur_runtime::parse_hex;
