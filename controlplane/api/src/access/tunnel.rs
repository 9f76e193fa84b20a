//! Tunnel grants: `TunnelAccessTemplate` (who may open a workstation tunnel in a namespace)
//! and `TunnelAccessRequest`.

use super::*;

/// Who may open a workstation tunnel (`spur local connect`) for work in this namespace, and
/// for how long.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "TunnelAccessTemplate",
    plural = "tunnelaccesstemplates",
    shortname = "tat",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessTemplateStatus",
    derive = "PartialEq",
    doc = "Who may open a time-bound workstation tunnel for this namespace (or a sandbox), and for how long (docs/access.md).",
    printcolumn(
        name = "Max",
        type_ = "string",
        json_path = ".spec.accessConfig.maxDuration"
    ),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct TunnelAccessTemplateSpec {
    /// `accessCommand` may use `{workstation}` and `{namespace}`; default:
    /// `spur local connect --token-file <token file>` (the CLI fills in the file; the token
    /// names the workstation).
    pub access_config: AccessConfig,
}

impl TunnelAccessTemplateSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        self.access_config.check(&mut c, "spec.accessConfig");
        c.finish("TunnelAccessTemplate")
    }
}

/// The tunnel command of a ready grant when the template names none.
pub const DEFAULT_TUNNEL_COMMAND: &str = "spur local connect --token-file <token file>";

impl AccessConfig {
    /// `accessCommand` (or the tunnel default) for one workstation.
    pub fn tunnel_command(&self, namespace: &str, workstation: &str) -> String {
        self.access_command
            .as_deref()
            .unwrap_or(DEFAULT_TUNNEL_COMMAND)
            .replace("{namespace}", namespace)
            .replace("{workstation}", workstation)
    }
}

/// A request for a workstation tunnel token, valid for the grant's duration. The workstation
/// makes the token and sends only its SHA-256: the token never passes through the API.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "spur.dev",
    version = "v1alpha1",
    kind = "TunnelAccessRequest",
    plural = "tunnelaccessrequests",
    shortname = "tar",
    category = "spur",
    category = "spur-access",
    namespaced,
    status = "AccessRequestStatus",
    derive = "PartialEq",
    doc = "A request for a time-bound workstation tunnel (spur local connect) under a TunnelAccessTemplate (docs/access.md).",
    printcolumn(name = "Template", type_ = "string", json_path = ".spec.templateName"),
    printcolumn(
        name = "Requester",
        type_ = "string",
        json_path = ".spec.requester.username"
    ),
    printcolumn(
        name = "Workstation",
        type_ = "string",
        json_path = ".spec.workstation"
    ),
    printcolumn(name = "Ready", type_ = "boolean", json_path = ".status.ready"),
    printcolumn(name = "Expires", type_ = "date", json_path = ".status.expiresAt"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self == oldSelf",
    "message": "a request cannot be changed: delete it and file a new one"
}]))]
pub struct TunnelAccessRequestSpec {
    /// The TunnelAccessTemplate (in this namespace).
    #[schemars(length(min = 1, max = DNS_SUBDOMAIN_MAX), regex(pattern = DNS_SUBDOMAIN_PATTERN))]
    pub template_name: String,
    /// The workstation's name (what Sandboxes' `local[].workstation` name). One user's at a
    /// time: while a grant of one user holds it, another's is refused.
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub workstation: String,
    /// SHA-256 of the token the workstation made, lowercase hex.
    #[schemars(length(min = 64, max = 64), regex(pattern = TOKEN_SHA256_PATTERN))]
    pub token_sha256: String,
    /// How long (default: the template's `defaultDuration`; capped at its `maxDuration`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 2, max = 24),
        regex(pattern = ACCESS_DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": DURATION_RULE, "message": DURATION_MESSAGE}])
    )]
    pub duration: Option<String>,
    /// The sandbox the tunnel is for (it must exist).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = DNS_LABEL_MAX), regex(pattern = DNS_LABEL_PATTERN))]
    pub sandbox: Option<String>,
    /// Who filed the request: set at admission from the API server's user info.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requester: Option<Requester>,
}

/// A token hash as a tunnel grant carries it.
pub const TOKEN_SHA256_PATTERN: &str = "^[0-9a-f]{64}$";

impl TunnelAccessRequestSpec {
    pub fn validate(&self) -> Result<(), Error> {
        let mut c = Checker::default();
        check_request(
            &mut c,
            &self.template_name,
            self.duration.as_deref(),
            self.sandbox.as_deref(),
        );
        c.dns_label(|| "spec.workstation".into(), &self.workstation);
        c.require(
            self.token_sha256.len() == 64
                && self
                    .token_sha256
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            || "spec.tokenSha256".into(),
            "must be 64 lowercase hex digits (a SHA-256)",
        );
        c.finish("TunnelAccessRequest")
    }
}
