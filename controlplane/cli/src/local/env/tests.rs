#![allow(clippy::unwrap_used)]

use serde_json::json;

use super::*;

/// Objects from a map; `forbidden` cannot be read.
#[derive(Default)]
struct Fake {
    objects: BTreeMap<(&'static str, String), Data>,
}

impl Fake {
    fn with(mut self, kind: &'static str, name: &str, data: &[(&str, &str)]) -> Self {
        self.objects.insert(
            (kind, name.to_owned()),
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), v.as_bytes().to_vec()))
                .collect(),
        );
        self
    }
}

impl Objects for Fake {
    async fn get(&mut self, kind: Kind, name: &str) -> Result<Option<Data>> {
        if name == "forbidden" {
            bail!("cannot read {} ns/{name}: forbidden", kind.name());
        }
        Ok(self.objects.get(&(kind.name(), name.to_owned())).cloned())
    }
}

fn template() -> PodTemplateSpec {
    serde_json::from_value(json!({
        "metadata": {"labels": {"app": "api"}, "annotations": {"team": "a"}},
        "spec": {
            "serviceAccountName": "api-sa",
            "containers": [
                {"name": "side", "image": "x"},
                {"name": "app", "image": "x",
                 "envFrom": [{"configMapRef": {"name": "common"}, "prefix": "C_"},
                             {"secretRef": {"name": "absent", "optional": true}}],
                 "env": [
                    {"name": "HOST", "value": "db"},
                    {"name": "URL", "value": "postgres://$(HOST):5432/$(DB)?x=$$(HOST)"},
                    {"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "db", "key": "password"}}},
                    {"name": "LEVEL", "valueFrom": {"configMapKeyRef": {"name": "common", "key": "level"}}},
                    {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "SA", "valueFrom": {"fieldRef": {"fieldPath": "spec.serviceAccountName"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory"}}}
                 ],
                 "volumeMounts": [
                    {"name": "cfg", "mountPath": "//etc/app/"},
                    {"name": "tls", "mountPath": "/etc/tls", "readOnly": true},
                    {"name": "one", "mountPath": "/etc/one.conf", "subPath": "level"},
                    {"name": "both", "mountPath": "/var/run/both"},
                    {"name": "scratch", "mountPath": "/tmp"},
                    {"name": "cfg", "mountPath": "/per-pod", "subPathExpr": "$(POD_NAME)"}
                 ]}
            ],
            "volumes": [
                {"name": "cfg", "configMap": {"name": "common"}},
                {"name": "tls", "secret": {"secretName": "db", "items": [{"key": "password", "path": "sub/pw"}]}},
                {"name": "one", "configMap": {"name": "common"}},
                {"name": "both", "projected": {"sources": [
                    {"configMap": {"name": "common", "items": [{"key": "level", "path": "lvl"}]}},
                    {"serviceAccountToken": {"path": "token"}}
                ]}},
                {"name": "scratch", "emptyDir": {}}
            ]
        }
    }))
    .unwrap()
}

fn local(extra: serde_json::Value) -> Local {
    let mut l = json!({
        "name": "api",
        "from": {"kind": "Deployment", "namespace": "shop", "name": "api"},
        "mappings": [{"port": 8080, "toLocal": "localhost:8080"}],
        "container": "app"
    });
    l.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    serde_json::from_value(l).unwrap()
}

fn objects() -> Fake {
    Fake::default()
        .with(
            "ConfigMap",
            "common",
            &[("level", "debug"), ("mode", "fast"), ("bad key", "x")],
        )
        .with("Secret", "db", &[("password", "s3cret")])
        .with(
            "Secret",
            &names::resource_name("sb", "db"),
            &[("provision.url", "postgres://fork")],
        )
}

#[tokio::test]
async fn the_baseline_containers_environment_as_the_kubelet_sets_it() {
    let mut o = objects();
    let r = resolve(&template(), &local(json!({})), "sb", &mut o)
        .await
        .unwrap();
    let env: Vec<(&str, &str)> = r
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        env,
        [
            ("C_level", "debug"),
            ("C_mode", "fast"),
            ("HOST", "db"),
            ("URL", "postgres://db:5432/$(DB)?x=$(HOST)"),
            ("PASSWORD", "s3cret"),
            ("LEVEL", "debug"),
            ("NS", "shop"),
            ("APP", "api"),
            ("SA", "api-sa"),
        ]
    );
    assert!(
        r.notes.iter().any(|n| n.contains("IP not set")),
        "{:?}",
        r.notes
    );
    assert!(
        r.notes.iter().any(|n| n.contains("MEM not set")),
        "{:?}",
        r.notes
    );
    assert!(
        r.notes.iter().any(|n| n.contains("volume scratch")),
        "{:?}",
        r.notes
    );
    assert!(
        r.notes
            .iter()
            .any(|n| n.contains("only its ConfigMap and Secret")),
        "{:?}",
        r.notes
    );
    let files: Vec<(&str, &str, bool)> = r
        .files
        .iter()
        .map(|f| {
            (
                f.path.as_str(),
                std::str::from_utf8(&f.content).unwrap(),
                f.secret,
            )
        })
        .collect();
    assert_eq!(
        files,
        [
            ("etc/app/bad key", "x", false),
            ("etc/app/level", "debug", false),
            ("etc/app/mode", "fast", false),
            ("etc/tls/sub/pw", "s3cret", true),
            ("etc/one.conf", "debug", false),
            ("var/run/both/lvl", "debug", false),
        ]
    );
}

#[tokio::test]
async fn the_sandboxs_env_and_files_go_on_top() {
    let l = local(json!({
        "env": [
            {"name": "LEVEL", "value": "trace on $(HOST)"},
            {"name": "PASSWORD", "operation": "delete"},
            {"name": "DB_URL", "valueFrom": {"resource": {"name": "db", "outputKey": "provision.url"}}},
            {"name": "OPT", "valueFrom": {"secret": {"name": "nope", "key": "k", "optional": true}}}
        ],
        "files": [
            {"path": "/etc/app/level", "value": "info"},
            {"path": "/home/dev/.pgpass", "valueFrom": {"resource": {"name": "db", "outputKey": "provision.url"}}}
        ]
    }));
    let mut o = objects();
    let r = resolve(&template(), &l, "sb", &mut o).await.unwrap();
    let get = |k: &str| r.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("LEVEL"), Some("trace on db"));
    assert_eq!(get("PASSWORD"), None);
    assert_eq!(get("DB_URL"), Some("postgres://fork"));
    assert_eq!(get("OPT"), None);
    let file = |p: &str| r.files.iter().find(|f| f.path == p).unwrap();
    assert_eq!(file("etc/app/level").content, b"info");
    assert!(!file("etc/app/level").secret);
    assert_eq!(file("home/dev/.pgpass").content, b"postgres://fork");
    assert!(file("home/dev/.pgpass").secret);
}

#[tokio::test]
async fn what_cannot_be_read_stops_it_with_the_reason() {
    let with = |env: serde_json::Value| local(json!({"env": env}));
    for (l, needle) in [
        (
            with(
                json!([{"name": "X", "valueFrom": {"secret": {"name": "forbidden", "key": "k"}}}]),
            ),
            "forbidden",
        ),
        (
            with(json!([{"name": "X", "valueFrom": {"secret": {"name": "db", "key": "nokey"}}}])),
            "has no key \"nokey\"",
        ),
        (local(json!({"container": "nope"})), "no container \"nope\""),
    ] {
        let err = resolve(&template(), &l, "sb", &mut objects())
            .await
            .unwrap_err();
        assert!(format!("{err:#}").contains(needle), "{err:#}");
    }
    // A baseline whose items would climb out of the files directory.
    let mut t = template();
    let spec = t.spec.as_mut().unwrap();
    spec.volumes.as_mut().unwrap()[1]
        .secret
        .as_mut()
        .unwrap()
        .items = Some(vec![KeyToPath {
        key: "password".into(),
        path: "../../../.ssh/authorized_keys".into(),
        mode: None,
    }]);
    let err = resolve(&t, &local(json!({})), "sb", &mut objects())
        .await
        .unwrap_err();
    assert!(format!("{err:#}").contains("refusing to write"), "{err:#}");
}

#[test]
fn outputs_quote_every_value() {
    let env = vec![
        ("A".to_owned(), "it's \"x\" $HOME\\n\nend".to_owned()),
        ("with-dash".to_owned(), "v".to_owned()),
    ];
    assert_eq!(
        dotenv(&env),
        "A=\"it's \\\"x\\\" \\$HOME\\\\n\\nend\"\nwith-dash=\"v\"\n"
    );
    let tick = vec![("B".to_owned(), "`id`".to_owned())];
    assert_eq!(dotenv(&tick), "B=\"\\`id\\`\"\n");
    assert_eq!(shell(&env), "export A='it'\\''s \"x\" $HOME\\n\nend'\n");
}

#[test]
fn files_are_written_with_their_modes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("files");
    write_files(
        &out,
        &[
            File {
                path: "etc/tls/key".into(),
                content: b"k".to_vec(),
                secret: true,
            },
            File {
                path: "etc/app.conf".into(),
                content: b"c".to_vec(),
                secret: false,
            },
        ],
    )
    .unwrap();
    let mode = |p: &str| std::fs::metadata(out.join(p)).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode("etc/tls/key"), 0o600);
    assert_eq!(mode("etc/app.conf"), 0o644);
    assert_eq!(
        std::fs::metadata(&out).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(std::fs::read(out.join("etc/tls/key")).unwrap(), b"k");
    // Again: the files are replaced, no temporary name is left behind.
    write_files(
        &out,
        &[File {
            path: "etc/tls/key".into(),
            content: b"k2".to_vec(),
            secret: true,
        }],
    )
    .unwrap();
    assert_eq!(std::fs::read(out.join("etc/tls/key")).unwrap(), b"k2");
    assert_eq!(std::fs::read_dir(out.join("etc/tls")).unwrap().count(), 1);
}

#[test]
fn files_are_never_written_through_links_or_into_shared_directories() {
    use std::os::unix::fs::PermissionsExt;
    let one = |path: &str| {
        vec![File {
            path: path.into(),
            content: b"secret".to_vec(),
            secret: true,
        }]
    };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("files");
    std::fs::create_dir(&out).unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o700)).unwrap();
    // A link planted inside the directory, to a directory and to a file.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, out.join("etc")).unwrap();
    let err = write_files(&out, &one("etc/key")).unwrap_err();
    assert!(format!("{err:#}").contains("symbolic link"), "{err:#}");
    std::os::unix::fs::symlink(elsewhere.join("target"), out.join("key")).unwrap();
    let err = write_files(&out, &one("key")).unwrap_err();
    assert!(format!("{err:#}").contains("symbolic link"), "{err:#}");
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    // The directory itself a link, or writable by others.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&out, &link).unwrap();
    assert!(write_files(&link, &one("a")).is_err());
    let shared = dir.path().join("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = write_files(&shared, &one("a")).unwrap_err();
    assert!(
        format!("{err:#}").contains("writable by you alone"),
        "{err:#}"
    );
    // A file where another needs a directory: nothing at all is written.
    let fresh = dir.path().join("fresh");
    let clash = [one("a/b").remove(0), one("a").remove(0), one("c").remove(0)];
    let err = write_files(&fresh, &clash).unwrap_err();
    assert!(
        format!("{err:#}").contains("both a file and a directory"),
        "{err:#}"
    );
    assert!(!fresh.exists());
}

/// A volume mounted at `/` puts its files at the top of the directory, never at an absolute
/// path (which would leave it).
#[tokio::test]
async fn a_volume_at_the_root_stays_in_the_directory() {
    let t: PodTemplateSpec = serde_json::from_value(json!({"spec": {
        "containers": [{"name": "app", "image": "x",
                        "volumeMounts": [{"name": "cfg", "mountPath": "/"}]}],
        "volumes": [{"name": "cfg", "configMap": {"name": "common",
                     "items": [{"key": "level", "path": "home/alice/.bashrc"}]}}]
    }}))
    .unwrap();
    let r = resolve(&t, &local(json!({})), "sb", &mut objects())
        .await
        .unwrap();
    assert_eq!(r.files.len(), 1);
    assert_eq!(r.files[0].path, "home/alice/.bashrc");
}
