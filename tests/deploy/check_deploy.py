#!/usr/bin/env python3
"""Offline checks of the deployment files in deploy/ and of docs/DEPLOY.md.

Each check is a subcommand (CTest runs one test per subcommand, label "deploy"):

  manifests      the Kubernetes manifests' schema and cross references, and every tensord flag
                 that deploy/ and docs/DEPLOY.md use appears in the built tensord's --help
  kustomize      `kubectl kustomize deploy/kubernetes` renders what the manifests say (skipped
                 when kubectl is not on PATH)
  systemd        `systemd-analyze verify` of the unit, and, under strace, that tensord's system
                 calls, socket families, writes and mappings stay inside the unit's sandbox
                 (each part skipped when its tool is missing or cannot run here)
  containerfile  every file the Containerfile copies or runs exists (and is executable), the
                 scripts it relies on behave as it assumes, and its final stage installs every
                 library the built tensord and tsctl load
  cluster        three real tensord processes started from the StatefulSet's own command and
                 args (pod name, paths and ports substituted), answering /healthz, /readyz,
                 /metrics, the Containerfile's HEALTHCHECK and tsctl ping
  selftest       the checks above catch drift: each of a list of small breakages, made in a
                 copy of the files, must make its check report the expected problem

Exit status: 0 passed, 1 failed (every problem is printed), 77 skipped (CTest SKIP_RETURN_CODE).
Every wait is bounded; every process started is stopped by its PID.
"""

import argparse
import binascii
import contextlib
import functools
import io
import http.client
import json
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time

SKIP = 77

# The tensord container and the files that hold it, by the names the manifests use.
STS_FILE = "statefulset.yaml"
CONTAINER = "tensord"
# Seconds: one tensord start (or stop) must finish within this, or the check fails.
PROCESS_WAIT_S = 15.0
# Seconds: one external tool (kubectl, systemd-analyze, strace's workload) must finish within this.
TOOL_TIMEOUT_S = 60.0

# apiVersion -> kinds this folder may use. Anything else is a typo or a kind the checks below
# do not know (add its required fields here before using it).
KNOWN_KINDS = {
    "v1": {"Service", "ConfigMap", "Secret"},
    "apps/v1": {"StatefulSet"},
    "policy/v1": {"PodDisruptionBudget"},
}

# Flags of other programs that docs/DEPLOY.md may name, by program. Every other --flag in the
# document must be one of tensord's or tsctl's (their --help output).
OTHER_TOOL_FLAGS = {
    "kubectl": {"--dry-run", "--from-literal", "--from-file", "--cert", "--key", "--namespace",
                "--selector", "--for", "--timeout", "--output", "--tail", "--type", "--watch"},
    "docker/podman": {"--format", "--file", "--tag", "--volume", "--publish", "--name", "--rm",
                      "--read-only", "--user", "--memory", "--detach", "--secret", "--env",
                      "--network", "--mount", "--health-cmd"},
    "openssl": {"--out"},
    "systemd": {"--now", "--offline", "--user", "--system", "--follow"},
    "apt/dpkg": {"--no-install-recommends"},
    "ctest": {"--test-dir", "--output-on-failure"},
    "cmake": {"--build", "--target", "--install", "--prefix"},
    "useradd/groupadd": {"--system", "--gid", "--uid", "--home-dir", "--shell", "--no-create-home"},
}

# How every program's output is captured: as text, with bytes that are not UTF-8 replaced (a
# message must reach the report even when a program prints garbage).
CAPTURE = {"capture_output": True, "text": True, "errors": "replace"}

FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


class Problems:
    """Collects failures so that one run reports all of them."""

    def __init__(self):
        self.items = []

    def add(self, where, what):
        self.items.append("%s: %s" % (where, what))

    def check(self, cond, where, what):
        if not cond:
            self.add(where, what)
        return cond

    def finish(self, name):
        if self.items:
            for p in self.items:
                print("FAIL " + p)
            print("%s: %d problem(s)" % (name, len(self.items)))
            return 1
        print("%s: ok" % name)
        return 0


def load_yaml_docs(path):
    import yaml  # python3-yaml; imported here so that the error names the package

    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def need_yaml():
    try:
        import yaml  # noqa: F401
    except ImportError:
        print("python3-yaml is missing (apt-get install python3-yaml; ./run.sh deps installs it)")
        sys.exit(1)


@functools.lru_cache(maxsize=None)
def tensord_help_flags(tensord):
    out = subprocess.run([tensord, "--help"], **CAPTURE,
                         timeout=TOOL_TIMEOUT_S)
    if out.returncode != 0:
        raise SystemExit("%s --help exited %d" % (tensord, out.returncode))
    return set(FLAG_RE.findall(out.stdout)), out.stdout


@functools.lru_cache(maxsize=None)
def program_help_flags(program):
    out = subprocess.run([program, "--help"], **CAPTURE,
                         timeout=TOOL_TIMEOUT_S)
    return set(FLAG_RE.findall(out.stdout + out.stderr))


# ---------------------------------------------------------------------------------------------
# Reading the deployment files


class Kube:
    """The Kubernetes folder: kustomization, documents by kind and name, the tensord container."""

    def __init__(self, src):
        self.dir = os.path.join(src, "deploy", "kubernetes")
        self.kustomization = load_yaml_docs(os.path.join(self.dir, "kustomization.yaml"))[0]
        self.docs = []  # (file, document)
        for name in sorted(os.listdir(self.dir)):
            if name.endswith(".yaml") and name != "kustomization.yaml":
                for d in load_yaml_docs(os.path.join(self.dir, name)):
                    self.docs.append((name, d))

    def of_kind(self, kind):
        return [(f, d) for f, d in self.docs if d.get("kind") == kind]

    def statefulset(self):
        sts = self.of_kind("StatefulSet")
        if len(sts) != 1:
            raise SystemExit("expected one StatefulSet in deploy/kubernetes, found %d" % len(sts))
        return sts[0][1]

    def container(self):
        spec = self.statefulset()["spec"]["template"]["spec"]
        for c in spec.get("containers", []):
            if c.get("name") == CONTAINER:
                return c
        raise SystemExit("the StatefulSet has no container named %s" % CONTAINER)

    def configmap(self, name):
        for _, d in self.of_kind("ConfigMap"):
            if d["metadata"]["name"] == name:
                return d
        return None


def container_script(c):
    """The container's `sh -c SCRIPT NAME` wrapper: (script, $0) or (None, None)."""
    cmd = c.get("command") or []
    if len(cmd) >= 3 and cmd[0] in ("/bin/sh", "sh") and cmd[1] == "-c":
        return cmd[2], (cmd[3] if len(cmd) > 3 else None)
    return None, None


def arg_value(args, flag):
    """The value after flag in an argument list (or of --flag=value), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a[len(flag) + 1:]
    return None


def kube_flags(src):
    """Every tensord flag the Kubernetes files use, with where: the container's args, the
    wrapper script's exec line, and the commented-out args (documentation that must not rot)."""
    found = []
    kube = Kube(src)
    c = kube.container()
    for a in c.get("args", []):
        if a.startswith("--"):
            found.append((a.split("=", 1)[0], "statefulset.yaml args"))
    script, _ = container_script(c)
    if script:
        for line in script.splitlines():
            if re.search(r"\btensord\b", line) and "exec" in line:
                for f in FLAG_RE.findall(line):
                    found.append((f, "statefulset.yaml command"))
    with open(os.path.join(kube.dir, STS_FILE), encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            m = re.match(r"\s*#\s*-\s*\"?(--[a-z][a-z0-9-]*)", line)
            if m:
                found.append((m.group(1), "statefulset.yaml:%d (comment)" % n))
    return found


def systemd_exec_start(src):
    """The unit's ExecStart= command line, continuation lines joined."""
    path = os.path.join(src, "deploy", "systemd", "tensord.service")
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("ExecStart="):
            return line[len("ExecStart="):]
    raise SystemExit("tensord.service has no ExecStart=")


def unit_settings(src):
    """The unit's key=value lines as a list of (section, key, value), in order."""
    path = os.path.join(src, "deploy", "systemd", "tensord.service")
    out = []
    section = None
    with open(path, encoding="utf-8") as f:
        text = f.read().replace("\\\n", " ")
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#") or s.startswith(";"):
            continue
        if s.startswith("[") and s.endswith("]"):
            section = s[1:-1]
            continue
        k, _, v = s.partition("=")
        out.append((section, k.strip(), v.strip()))
    return out


def systemd_flags(src):
    found = []
    for f in FLAG_RE.findall(systemd_exec_start(src)):
        found.append((f, "tensord.service ExecStart"))
    path = os.path.join(src, "deploy", "systemd", "tensord.default")
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if re.match(r"\s*#?\s*TENSORD_EXTRA_ARGS=", line):
                for f in FLAG_RE.findall(line.split("=", 1)[1]):
                    found.append((f, "tensord.default:%d" % n))
    return found


def containerfile_instructions(src):
    """(line number, INSTRUCTION, arguments) of deploy/Containerfile, continuations joined."""
    path = os.path.join(src, "deploy", "Containerfile")
    out = []
    cur, start = "", 0
    with open(path, encoding="utf-8") as f:
        for n, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if not cur and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if cur and line.lstrip().startswith("#"):
                continue
            if not cur:
                start = n
            if line.endswith("\\"):
                cur += line[:-1] + " "
                continue
            cur += line
            word, _, rest = cur.strip().partition(" ")
            out.append((start, word.upper(), rest.strip()))
            cur = ""
    return out


def containerfile_exec_form(rest):
    """The JSON array of an exec-form CMD/ENTRYPOINT/HEALTHCHECK CMD, or None."""
    rest = rest.strip()
    if rest.startswith("["):
        return json.loads(rest)
    return None


def containerfile_flags(src):
    found = []
    for n, ins, rest in containerfile_instructions(src):
        if ins in ("CMD", "ENTRYPOINT"):
            arr = containerfile_exec_form(rest)
            if arr is None:
                found.append(("<shell form>", "Containerfile:%d %s (use the exec form)" % (n, ins)))
                continue
            for a in arr:
                if a.startswith("--"):
                    found.append((a.split("=", 1)[0], "Containerfile:%d %s" % (n, ins)))
    return found


def doc_flags(src):
    """docs/DEPLOY.md: every --flag that is not another tool's (OTHER_TOOL_FLAGS) must be
    tensord's or tsctl's."""
    others = set().union(*OTHER_TOOL_FLAGS.values())
    found = []
    path = os.path.join(src, "docs", "DEPLOY.md")
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            for fl in FLAG_RE.findall(line):
                if fl not in others:
                    found.append((fl, "docs/DEPLOY.md:%d" % n))
    return found


# ---------------------------------------------------------------------------------------------
# manifests


def labels_match(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def parse_quantity(q):
    """A Kubernetes memory quantity ("4Gi", "512M", "1000") in bytes."""
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12}
    m = re.fullmatch(r"([0-9]+)([A-Za-z]*)", str(q))
    if not m or (m.group(2) and m.group(2) not in units):
        raise ValueError("bad quantity %r" % q)
    return int(m.group(1)) * units.get(m.group(2), 1)


def check_probe(p, where, probe, port_names, port_numbers):
    if not p.check(isinstance(probe, dict), where, "missing"):
        return
    get = probe.get("httpGet")
    if not p.check(isinstance(get, dict), where, "not an httpGet probe"):
        return
    port = get.get("port")
    if isinstance(port, str):
        p.check(port in port_names, where, "port %r is not a named container port" % port)
    else:
        p.check(port in port_numbers, where, "port %r is not a container port" % port)
    p.check(str(get.get("path", "")).startswith("/"), where, "no path")


def check_manifests(src, tensord, tsctl):
    need_yaml()
    p = Problems()
    kube = Kube(src)
    k = kube.kustomization

    # Every document: a known kind, a name, and no namespace of its own.
    for f, d in kube.docs:
        where = "%s %s/%s" % (f, d.get("kind"), (d.get("metadata") or {}).get("name"))
        api, kind = d.get("apiVersion"), d.get("kind")
        p.check(kind in KNOWN_KINDS.get(api, set()), where,
                "apiVersion %r with kind %r is not one this folder knows" % (api, kind))
        md = d.get("metadata") or {}
        p.check(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", str(md.get("name", ""))),
                where, "metadata.name is not a DNS label")
        p.check("namespace" not in md, where,
                "has its own namespace (the kustomization sets it)")

    # The kustomization lists every manifest and nothing else.
    files = sorted({f for f, _ in kube.docs})
    p.check(sorted(k.get("resources", [])) == files, "kustomization.yaml",
            "resources %s are not the folder's manifests %s" % (k.get("resources"), files))
    ns = k.get("namespace")
    p.check(isinstance(ns, str) and ns, "kustomization.yaml", "no namespace")

    services = {d["metadata"]["name"]: d for _, d in kube.of_kind("Service")}
    sts = kube.statefulset()
    spec = sts.get("spec", {})
    tmpl = spec.get("template", {})
    pod_labels = tmpl.get("metadata", {}).get("labels", {})
    pod = tmpl.get("spec", {})
    c = kube.container()
    where = "statefulset.yaml"

    # StatefulSet: selector, service, replicas.
    p.check(labels_match(spec.get("selector", {}).get("matchLabels"), pod_labels), where,
            "selector.matchLabels do not match the pod template's labels")
    svc_name = spec.get("serviceName")
    headless = services.get(svc_name)
    p.check(headless is not None, where, "serviceName %r names no Service here" % svc_name)
    if headless:
        p.check(headless["spec"].get("clusterIP") == "None", where,
                "serviceName %r is not a headless Service (clusterIP: None)" % svc_name)
    replicas = spec.get("replicas")
    p.check(isinstance(replicas, int) and replicas >= 1, where, "replicas missing")

    # The container: image placeholder, ports, probes, resources, security.
    ports = c.get("ports", [])
    port_names = {pt.get("name"): pt.get("containerPort") for pt in ports}
    port_numbers = set(port_names.values())
    for pt in ports:
        name = str(pt.get("name", ""))
        p.check(re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 15,
                where, "port name %r is not an IANA service name (15 characters at most)" % name)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        check_probe(p, "%s %s" % (where, probe), c.get(probe), port_names, port_numbers)
    if isinstance(c.get("readinessProbe"), dict):
        p.check(c["readinessProbe"].get("httpGet", {}).get("path") == "/readyz", where,
                "the readiness probe is not /readyz")
    if isinstance(c.get("livenessProbe"), dict):
        p.check(c["livenessProbe"].get("httpGet", {}).get("path") == "/healthz", where,
                "the liveness probe is not /healthz")
    res = c.get("resources", {})
    p.check(res.get("requests", {}).get("memory") and res.get("requests", {}).get("cpu"),
            where, "resources.requests needs memory and cpu")
    limit = res.get("limits", {}).get("memory")
    p.check(limit, where, "resources.limits.memory missing")
    images = [i.get("name") for i in k.get("images", [])]
    p.check(c.get("image") in images, where,
            "image %r is not renamed by kustomization.yaml's images" % c.get("image"))

    psc = pod.get("securityContext", {})
    csc = c.get("securityContext", {})
    p.check(psc.get("runAsNonRoot") is True, where, "pod runAsNonRoot is not true")
    p.check(isinstance(psc.get("runAsUser"), int) and psc["runAsUser"] > 0, where,
            "runAsUser is not a non-root uid")
    users = [rest for _, i, rest in containerfile_instructions(src) if i == "USER"]
    p.check(users and users[-1].split(":")[0] == str(psc.get("runAsUser")), where,
            "runAsUser %s is not the image's USER %s (deploy/Containerfile)"
            % (psc.get("runAsUser"), users[-1] if users else None))
    p.check(psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", where,
            "seccompProfile is not RuntimeDefault")
    p.check(csc.get("readOnlyRootFilesystem") is True, where, "readOnlyRootFilesystem not set")
    p.check(csc.get("allowPrivilegeEscalation") is False, where,
            "allowPrivilegeEscalation is not false")
    p.check(csc.get("capabilities", {}).get("drop") == ["ALL"], where,
            "capabilities.drop is not [ALL]")

    # Volumes: every mount names a volume or a claim template; config maps exist here; secrets
    # are the user's and docs/DEPLOY.md tells how to make each.
    volumes = {v.get("name"): v for v in pod.get("volumes", [])}
    claims = {t.get("metadata", {}).get("name") for t in spec.get("volumeClaimTemplates", [])}
    mounts = {m.get("name"): m.get("mountPath") for m in c.get("volumeMounts", [])}
    for name in mounts:
        p.check(name in volumes or name in claims, where,
                "volumeMount %r names no volume or claim template" % name)
    for name in list(volumes) + list(claims):
        p.check(name in mounts, where, "volume %r is never mounted" % name)
    with open(os.path.join(src, "docs", "DEPLOY.md"), encoding="utf-8") as f:
        deploy_md = f.read()
    for name, v in volumes.items():
        if "configMap" in v:
            p.check(kube.configmap(v["configMap"].get("name")) is not None, where,
                    "volume %r: no ConfigMap %r here" % (name, v["configMap"].get("name")))
        if "secret" in v:
            sn = v["secret"].get("secretName")
            p.check(sn and sn in deploy_md, where,
                    "volume %r: docs/DEPLOY.md does not say how to make Secret %r" % (name, sn))
            mode = v["secret"].get("defaultMode")
            p.check(mode is not None and mode & 0o077 & ~0o040 == 0, where,
                    "volume %r: secret files readable beyond the pod's group" % name)

    # Services and the disruption budget select the shards' pods, on ports the container has.
    for name, s in services.items():
        w = "service.yaml Service/%s" % name
        p.check(labels_match(s.get("spec", {}).get("selector"), pod_labels), w,
                "selector does not match the shards' pod labels")
        for pt in s.get("spec", {}).get("ports", []):
            tp = pt.get("targetPort", pt.get("port"))
            ok = tp in port_names if isinstance(tp, str) else tp in port_numbers
            p.check(ok, w, "targetPort %r is not a container port" % tp)
    pdbs = kube.of_kind("PodDisruptionBudget")
    p.check(len(pdbs) == 1, "pdb.yaml", "expected one PodDisruptionBudget")
    for f, d in pdbs:
        w = "%s PodDisruptionBudget/%s" % (f, d["metadata"]["name"])
        s = d.get("spec", {})
        p.check(labels_match(s.get("selector", {}).get("matchLabels"), pod_labels), w,
                "selector does not match the shards' pod labels")
        p.check(s.get("maxUnavailable") == 1 and "minAvailable" not in s, w,
                "not maxUnavailable: 1")
    for f, d in kube.of_kind("Secret"):
        p.check("data" in d or "stringData" in d, "%s Secret" % f, "no data")

    # The daemon's args agree with the ports, the probes, the annotations and the mounts.
    args = c.get("args", [])
    port = arg_value(args, "--port")
    http_port = arg_value(args, "--http-port")
    p.check(port is not None and int(port) == port_names.get("tensorshare"), where,
            "--port %s is not the container port named tensorshare" % port)
    p.check(http_port is not None and int(http_port) == port_names.get("metrics"), where,
            "--http-port %s is not the container port named metrics" % http_port)
    ann = tmpl.get("metadata", {}).get("annotations", {})
    p.check(ann.get("prometheus.io/scrape") == "true", where, "no prometheus.io/scrape")
    p.check(str(ann.get("prometheus.io/port")) == str(http_port), where,
            "prometheus.io/port is not --http-port")
    p.check(ann.get("prometheus.io/path") == "/metrics", where, "prometheus.io/path not /metrics")
    for flag in ("--cluster-map", "--auth-token-file", "--save"):
        val = arg_value(args, flag)
        p.check(val and any(val.startswith(mp.rstrip("/") + "/") for mp in mounts.values()),
                where, "%s %s is not on a mounted volume" % (flag, val))
    save = arg_value(args, "--save")
    if save:
        p.check(any(save.startswith(mounts[cl].rstrip("/") + "/") for cl in claims
                    if cl in mounts), where, "--save is not on a persistent volume claim")
    p.check(arg_value(args, "--save-interval") is not None, where, "no --save-interval")
    p.check(arg_value(args, "--host") == "0.0.0.0", where, "--host is not 0.0.0.0")

    # The wrapper: the shard index from the pod, --shard I/N with N = replicas, --max-memory
    # from the memory limit, below it.
    script, _ = container_script(c)
    env = {e.get("name"): e for e in c.get("env", [])}
    if p.check(script is not None, where, "the command is not an `sh -c` wrapper"):
        m = re.search(r'--shard "\$i/([0-9]+)"', script)
        p.check(m and int(m.group(1)) == replicas, where,
                "--shard's N is not the StatefulSet's replicas (%s)" % replicas)
        p.check("POD_NAME##*-" in script, where, "no fallback to the pod name's ordinal")
        p.check(env.get("POD_NAME", {}).get("valueFrom", {}).get("fieldRef", {})
                .get("fieldPath") == "metadata.name", where, "POD_NAME is not metadata.name")
        p.check(env.get("POD_INDEX", {}).get("valueFrom", {}).get("fieldRef", {})
                .get("fieldPath") == "metadata.labels['apps.kubernetes.io/pod-index']",
                where, "POD_INDEX is not the pod-index label")
        rf = env.get("MEMORY_LIMIT", {}).get("valueFrom", {}).get("resourceFieldRef", {})
        p.check(rf.get("resource") == "limits.memory" and rf.get("containerName") == CONTAINER
                and str(rf.get("divisor", "1")) == "1", where,
                "MEMORY_LIMIT is not this container's limits.memory in bytes")
        mm = re.search(r'--max-memory "\$\(\(MEMORY_LIMIT / ([0-9]+) \* ([0-9]+)\)\)"', script)
        if p.check(mm, where, "--max-memory is not derived from MEMORY_LIMIT") and limit:
            lim = parse_quantity(limit)
            mem = lim // int(mm.group(1)) * int(mm.group(2))
            p.check(0 < mem <= lim * 0.8, where,
                    "--max-memory %d leaves less than 20%% of the %s limit" % (mem, limit))

    # The cluster map: one line per shard, each the shard's stable DNS name in the
    # kustomization's namespace, on the protocol port.
    cm_path = arg_value(args, "--cluster-map")
    cm_vol = next((v for v in volumes.values() if "configMap" in v), None)
    if cm_path and cm_vol:
        cm = kube.configmap(cm_vol["configMap"]["name"])
        key = os.path.basename(cm_path)
        text = (cm or {}).get("data", {}).get(key)
        if p.check(text is not None, "configmap.yaml", "no key %r for --cluster-map" % key):
            lines = [ln.split("#", 1)[0].strip() for ln in text.splitlines()]
            lines = [ln for ln in lines if ln and not ln.startswith("epoch ")]
            p.check(len(lines) == replicas, "configmap.yaml",
                    "%d shard lines for %s replicas" % (len(lines), replicas))
            for i, ln in enumerate(lines):
                want = "%s-%d.%s.%s.svc.cluster.local:%s" % (
                    sts["metadata"]["name"], i, svc_name, ns, port)
                p.check(ln == want, "configmap.yaml", "line %d is %r, not %r" % (i, ln, want))

    # Every tensord flag in deploy/ and docs/DEPLOY.md is one the built tensord has.
    help_flags, _ = tensord_help_flags(tensord)
    tools = help_flags | program_help_flags(tsctl)
    used = kube_flags(src) + systemd_flags(src) + containerfile_flags(src)
    for flag, w in used:
        p.check(flag in help_flags, w, "%s is not in `tensord --help`" % flag)
    for flag, w in doc_flags(src):
        p.check(flag in tools, w, "%s is in neither `tensord --help` nor `tsctl --help` "
                "(nor another tool's list in tests/deploy/check_deploy.py)" % flag)
    return p.finish("manifests")


# ---------------------------------------------------------------------------------------------
# kustomize


def check_kustomize(src):
    need_yaml()
    import yaml

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        print("kubectl is not on PATH: skipped")
        return SKIP
    p = Problems()
    kube = Kube(src)
    out = subprocess.run([kubectl, "kustomize", kube.dir], **CAPTURE,
                         timeout=TOOL_TIMEOUT_S)
    if out.returncode != 0:
        print(out.stderr)
        p.add("kubectl kustomize", "exited %d" % out.returncode)
        return p.finish("kustomize")
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    ns = kube.kustomization["namespace"]
    p.check(len(rendered) == len(kube.docs), "kustomize",
            "%d documents rendered from %d" % (len(rendered), len(kube.docs)))
    for d in rendered:
        w = "rendered %s/%s" % (d.get("kind"), d["metadata"].get("name"))
        p.check(d["metadata"].get("namespace") == ns, w, "not in namespace %s" % ns)
        if d.get("kind") == "StatefulSet":
            c = d["spec"]["template"]["spec"]["containers"][0]
            img = kube.kustomization["images"][0]
            want = "%s:%s" % (img["newName"], img["newTag"])
            p.check(c["image"] == want, w, "image %r, not %r" % (c["image"], want))
            vols = d["spec"]["template"]["spec"]["volumes"]
            for v in vols:
                if "secret" in v:
                    p.check(v["secret"].get("defaultMode") == 0o400, w,
                            "secret defaultMode %r is not 0400" % v["secret"].get("defaultMode"))
    return p.finish("kustomize")


# ---------------------------------------------------------------------------------------------
# systemd


def expand_syscall_set(analyze, name, seen=None):
    """The system calls of a systemd set (@name), its nested sets expanded."""
    seen = set() if seen is None else seen
    if name in seen:
        return set()
    seen.add(name)
    out = subprocess.run([analyze, "syscall-filter", name], **CAPTURE,
                         timeout=TOOL_TIMEOUT_S)
    calls = set()
    for line in out.stdout.splitlines()[1:]:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        w = s.split()[0]
        if w.startswith("@"):
            calls |= expand_syscall_set(analyze, w, seen)
        else:
            calls.add(w)
    return calls


def write_npy_zeros(path, n_floats):
    """A float32 .npy file of n_floats zeros (format 1.0), without NumPy."""
    header = "{'descr': '<f4', 'fortran_order': False, 'shape': (%d,), }" % n_floats
    pad = 64 - (10 + len(header) + 1) % 64
    header += " " * pad + "\n"
    with open(path, "wb") as f:
        f.write(b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode())
        f.write(b"\0" * (4 * n_floats))


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_file(path, proc, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def stop_process(proc, seconds=PROCESS_WAIT_S):
    """SIGTERM by PID, wait, then SIGKILL. The exit status, or None when it had to be killed."""
    if proc.poll() is not None:
        return proc.returncode
    os.kill(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=seconds)
        return None


def traced_pid(trace):
    """The PID of the first process in an strace -f output file (the traced program), or None."""
    try:
        with open(trace, encoding="utf-8", errors="replace") as f:
            m = re.match(r"(\d+)\s", f.readline())
    except OSError:
        return None
    return int(m.group(1)) if m else None


# The self-test turns the strace part off where a case does not need it (it takes seconds).
STRACE_ENABLED = True
# The sanitizers this build uses (CMake's TS_SANITIZE), empty for none. Their run-time makes
# calls and loads libraries of its own (ptrace for the leak check at exit, libasan), which say
# nothing about the deployed binary: the strace part and the runtime packages are checked only
# in a build without them.
SANITIZE = ""


def run_traced(strace, tensord, args, tmp, tag, workload, p):
    """Run tensord ARGS under strace -f (trace in tmp/TAG.trace), wait for its --port-file
    (which args must name as tmp/TAG.port), call workload(port), then stop it with SIGTERM.
    Returns the trace's lines, or None when strace cannot trace here."""
    trace = os.path.join(tmp, tag + ".trace")
    portfile = os.path.join(tmp, tag + ".port")
    proc = subprocess.Popen([strace, "-f", "-qq", "-o", trace, tensord] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc = None
    try:
        if not wait_file(portfile, proc, PROCESS_WAIT_S):
            out = proc.stdout.read().decode(errors="replace") if proc.poll() is not None else ""
            if "ptrace" in out.lower() or "operation not permitted" in out.lower():
                print("strace cannot trace here (%s): the sandbox check is skipped"
                      % out.strip().splitlines()[0])
                return None
            p.add("strace", "tensord (%s) did not start under strace: %s" % (tag, out))
            return []
        workload(open(portfile).read().strip())
    finally:
        # proc is strace: the signal goes to tensord, the first process of the trace (strace
        # itself would detach and leave tensord running); strace then exits with tensord's
        # status.
        pid = traced_pid(trace)
        if pid is not None and proc.poll() is None:
            os.kill(pid, signal.SIGTERM)
            try:
                rc = proc.wait(timeout=PROCESS_WAIT_S)
            except subprocess.TimeoutExpired:
                os.kill(pid, signal.SIGKILL)
        if rc is None:
            stop_process(proc)
            rc = proc.returncode
    p.check(rc == 0, "strace", "tensord (%s) exited %r under strace" % (tag, rc))
    with open(trace, encoding="utf-8", errors="replace") as f:
        return f.read().splitlines()


def strace_sandbox(src, tensord, tsctl, settings, analyze, p):
    """Run tensord under strace through a workload and check what it did against the unit's
    sandbox: TCP and unix clients, a 4 MiB upload over the unix socket (received into a memfd),
    a SAVE, the HTTP endpoints, and, in a second run, a TLS handshake; then a shutdown each.
    Returns False when strace cannot run here."""
    strace = shutil.which("strace")
    if not STRACE_ENABLED:
        return False
    if SANITIZE:
        print("a %s build: the strace part is checked in a build without sanitizers" % SANITIZE)
        return False
    if strace is None:
        print("strace is not on PATH: the sandbox check is skipped")
        return False
    allow = set()
    deny = set()
    families = set()
    for sec, key, val in settings:
        if sec == "Service" and key == "SystemCallFilter":
            target = deny if val.startswith("~") else allow
            for w in val.lstrip("~").split():
                target |= expand_syscall_set(analyze, w) if w.startswith("@") else {w}
        if sec == "Service" and key == "RestrictAddressFamilies":
            families |= set(val.split())
    help_flags, _ = tensord_help_flags(tensord)
    with tempfile.TemporaryDirectory(prefix="ts-deploy-strace-") as tmp:
        state = os.path.join(tmp, "state")
        runtime = os.path.join(tmp, "runtime")
        os.mkdir(state, 0o700)
        os.mkdir(runtime, 0o750)
        token = os.path.join(tmp, "token")
        with open(token, "w") as f:
            f.write("deploy-check-token\n")
        os.chmod(token, 0o600)
        sock = os.path.join(runtime, "tensord.sock")
        big = os.path.join(tmp, "big.npy")
        write_npy_zeros(big, 1 << 20)  # 4 MiB: above --shm-min's default 1 MiB
        http = "--http-port" in help_flags and "--http-port-file" in help_flags
        args = ["--port", "0", "--port-file", os.path.join(tmp, "main.port"), "--unix", sock,
                "--auth-token-file", token, "--save", os.path.join(state, "tensord.snap"),
                "--save-interval", "1"]
        if http:
            args += ["--http-port", "0", "--http-port-file", os.path.join(tmp, "http.port")]

        def main_workload(port):
            base = [tsctl, "-T", token, "-t", "10000"]
            steps = [
                base + ["-p", port, "put", "a", "1.5"],
                base + ["-p", port, "append", "a", "[1,2,3]"],
                base + ["-u", sock, "put", "big", big],
                base + ["-u", sock, "peek", "big", "--out", os.path.join(tmp, "out.npy")],
                base + ["-u", sock, "get", "big"],
                base + ["-p", port, "list"],
                base + ["-p", port, "save"],
            ]
            for st in steps:
                r = subprocess.run(st, **CAPTURE, timeout=TOOL_TIMEOUT_S)
                p.check(r.returncode == 0, "strace workload",
                        "%s: %s" % (" ".join(st[4:]), r.stderr.strip()))
            if http:
                hport = int(open(os.path.join(tmp, "http.port")).read())
                for path in ("/healthz", "/readyz", "/metrics"):
                    try:
                        status, _ = http_get(hport, path)
                        p.check(status == 200, "strace workload", "%s: %d" % (path, status))
                    except OSError as e:
                        p.add("strace workload", "%s: %s" % (path, e))

        lines = run_traced(strace, tensord, args, tmp, "main", main_workload, p)
        if lines is None:
            return False
        openssl = shutil.which("openssl")
        tls_ran = False
        if "--tls-cert" in help_flags and openssl is not None:
            key, crt = os.path.join(tmp, "tls.key"), os.path.join(tmp, "tls.crt")
            r = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt",
                                "ec_paramgen_curve:prime256v1", "-nodes", "-subj", "/CN=localhost",
                                "-days", "1", "-keyout", key, "-out", crt],
                               **CAPTURE, timeout=TOOL_TIMEOUT_S)
            p.check(r.returncode == 0, "openssl req", r.stderr.strip())

            def tls_workload(port):
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                try:
                    with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as raw:
                        with ctx.wrap_socket(raw, server_hostname="localhost") as t:
                            p.check(t.version() is not None, "strace TLS", "no handshake")
                except OSError as e:
                    p.add("strace TLS", "handshake with tensord --tls-cert: %s" % e)

            if r.returncode == 0:
                more = run_traced(strace, tensord,
                                  ["--host", "127.0.0.1", "--port", "0", "--port-file",
                                   os.path.join(tmp, "tls.port"), "--auth-token-file", token,
                                   "--tls-cert", crt, "--tls-key", key],
                                  tmp, "tls", tls_workload, p)
                lines += more or []
                tls_ran = bool(more)
        # tensord's own calls (execve is strace starting it).
        calls = set()
        for ln in lines:
            m = re.match(r"^\d+\s+(?:<\.\.\. )?([a-z_0-9]+)[( ]", ln)
            if m:
                calls.add(m.group(1))
        calls.discard("execve")
        print("strace: %d distinct system calls of tensord (runs: main%s%s)" % (
            len(calls), " with HTTP" if http else "", ", TLS" if tls_ran else ""))
        for c in sorted(calls):
            p.check(c in allow and c not in deny, "SystemCallFilter",
                    "tensord calls %s, which the unit forbids" % c)
        for ln in lines:
            m = re.search(r"\bsocket\((AF_[A-Z0-9]+)", ln)
            if m:
                p.check(m.group(1) in families, "RestrictAddressFamilies",
                        "tensord opens an %s socket" % m.group(1))
            if re.search(r"\b(mmap|mprotect)\(.*PROT_WRITE\|PROT_EXEC|PROT_EXEC\|PROT_WRITE", ln):
                p.add("MemoryDenyWriteExecute", "a writable and executable mapping: " + ln)
            if re.search(r"\bmprotect\(.*PROT_EXEC", ln):
                p.add("MemoryDenyWriteExecute", "a mapping made executable: " + ln)
            m = re.search(r'\bopenat\([^"]*"([^"]*)", ([A-Z_|]+)', ln)
            if m and m.group(1).startswith("/proc/"):
                p.check(re.match(r"/proc/(self|thread-self|\d+)/", m.group(1)), "ProcSubset=pid",
                        "tensord opens %s, which ProcSubset=pid hides" % m.group(1))
            if m and re.search(r"O_WRONLY|O_RDWR|O_CREAT", m.group(2)):
                path = m.group(1)
                ok = (path.startswith(state + "/") or path.startswith(runtime + "/") or
                      re.fullmatch(re.escape(tmp) + r"/[a-z]+\.port\.tmp\.\d+", path) or
                      path == "/dev/null")
                p.check(ok, "ProtectSystem=strict", "tensord writes %s" % path)
    return True


def check_systemd(src, tensord, tsctl):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        print("systemd-analyze is not on PATH: skipped")
        return SKIP
    p = Problems()
    settings = unit_settings(src)
    svc = {}
    for sec, k, v in settings:
        if sec == "Service":
            svc.setdefault(k, []).append(v)

    # The unit says what the brief of a sandboxed daemon needs, and its paths agree.
    for key, want in (("Type", "simple"), ("DynamicUser", "yes"), ("ProtectSystem", "strict"),
                      ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("PrivateDevices", "yes"),
                      ("NoNewPrivileges", "yes"), ("MemoryDenyWriteExecute", "yes"),
                      ("LockPersonality", "yes"), ("RestrictNamespaces", "yes"),
                      ("CapabilityBoundingSet", ""), ("Restart", "on-failure"),
                      ("StateDirectory", "tensord"), ("RuntimeDirectory", "tensord")):
        p.check(svc.get(key) == [want], "tensord.service", "%s= is %r, not %r"
                % (key, svc.get(key), want))
    p.check("ExecReload" not in svc, "tensord.service", "ExecReload= (tensord ignores SIGHUP)")
    p.check("LimitNOFILE" in svc, "tensord.service", "no LimitNOFILE=")
    p.check(svc.get("RestrictAddressFamilies") == ["AF_INET AF_INET6 AF_UNIX"],
            "tensord.service", "RestrictAddressFamilies= is not AF_INET AF_INET6 AF_UNIX")
    exec_start = systemd_exec_start(src)
    words = exec_start.split()
    save = arg_value(words, "--save") or ""
    unix = arg_value(words, "--unix") or ""
    p.check(save.startswith("/var/lib/tensord/"), "ExecStart", "--save is not in StateDirectory")
    p.check(unix.startswith("/run/tensord/"), "ExecStart", "--unix is not in RuntimeDirectory")
    p.check(arg_value(words, "--auth-token-file") == "%d/token" and
            any(v.startswith("token:") for v in svc.get("LoadCredential", [])), "ExecStart",
            "the token is not the credential 'token' (LoadCredential=, %d/token)")

    # systemd-analyze verify on a copy whose ExecStart is the built tensord (verify checks
    # that the program exists); any complaint about the unit (an unknown key, a bad value)
    # fails the check.
    with tempfile.TemporaryDirectory(prefix="ts-deploy-unit-") as tmp:
        unit = os.path.join(tmp, "tensord.service")
        with open(os.path.join(src, "deploy", "systemd", "tensord.service"), encoding="utf-8") \
                as f:
            text = f.read()
        p.check("ExecStart=/usr/local/bin/tensord " in text, "tensord.service",
                "ExecStart is not /usr/local/bin/tensord")
        with open(unit, "w", encoding="utf-8") as f:
            f.write(text.replace("ExecStart=/usr/local/bin/tensord ", "ExecStart=%s " % tensord))
        out = subprocess.run([analyze, "verify", unit], **CAPTURE,
                             timeout=TOOL_TIMEOUT_S, cwd=tmp)
        complaints = [ln for ln in (out.stdout + out.stderr).splitlines()
                      if "tensord.service" in ln or unit in ln]
        if out.returncode != 0 and "offline" in out.stderr.lower() and not complaints:
            print("systemd-analyze verify cannot run here: %s" % out.stderr.strip())
        else:
            p.check(out.returncode == 0, "systemd-analyze verify",
                    "exited %d: %s" % (out.returncode, out.stderr.strip()))
            for ln in complaints:
                p.add("systemd-analyze verify", ln)
    strace_sandbox(src, tensord, tsctl, settings, analyze, p)
    return p.finish("systemd")


# ---------------------------------------------------------------------------------------------
# containerfile


@functools.lru_cache(maxsize=None)
def runtime_packages(binary):
    """The Debian packages of the shared libraries binary loads (libc6 left out: every image
    has it), or None when ldd or dpkg cannot tell."""
    out = subprocess.run(["ldd", binary], **CAPTURE,
                         timeout=TOOL_TIMEOUT_S)
    if out.returncode != 0:
        return None
    pkgs = set()
    for ln in out.stdout.splitlines():
        m = re.search(r"=>\s+(/\S+)", ln)
        if not m:
            continue
        lib = os.path.realpath(m.group(1))
        if os.path.basename(lib).startswith("libtensorshare"):
            continue
        q = subprocess.run(["dpkg", "-S", lib], **CAPTURE,
                           timeout=TOOL_TIMEOUT_S)
        if q.returncode != 0:
            # The usrmerge layout: dpkg knows /lib/... while realpath gave /usr/lib/...
            alt = lib[4:] if lib.startswith("/usr/") else lib
            q = subprocess.run(["dpkg", "-S", alt], **CAPTURE,
                               timeout=TOOL_TIMEOUT_S)
        if q.returncode != 0:
            return None
        pkg = q.stdout.split(":", 1)[0].strip()
        if pkg != "libc6":
            pkgs.add(pkg)
    return pkgs


def check_containerfile(src, tensord, tsctl):
    p = Problems()
    ins = containerfile_instructions(src)
    froms = [(n, rest) for n, i, rest in ins if i == "FROM"]
    p.check(len(froms) == 2 and froms[0][1].startswith("debian:12 ") and
            froms[1][1] == "debian:12-slim", "Containerfile",
            "not two stages FROM debian:12 AS ... and FROM debian:12-slim: %s" % froms)
    stages = {rest.split()[-1] for _, rest in froms if " AS " in rest.upper()}
    final_start = froms[-1][0] if froms else 0

    # COPY: sources from the build context exist; --from names a stage.
    for n, i, rest in ins:
        if i != "COPY":
            continue
        words = shlex.split(rest)
        opts = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        frm = [o.split("=", 1)[1] for o in opts if o.startswith("--from=")]
        if frm:
            p.check(frm[0] in stages, "Containerfile:%d" % n, "--from=%s is no stage" % frm[0])
            continue
        for s in paths[:-1]:
            p.check(os.path.exists(os.path.join(src, s)), "Containerfile:%d" % n,
                    "COPY source %s does not exist in the repository" % s)

    # RUN: every repository script it runs exists and is executable; the scripts those run
    # too (deploy/install.sh runs ./run.sh serve).
    scripts = set()
    for n, i, rest in ins:
        if i != "RUN":
            continue
        for seg in re.split(r"&&|\|\||;|\|", rest):
            w = seg.split()
            if w and "/" in w[0] and not w[0].startswith("/"):
                scripts.add((n, w[0]))
    p.check(any(s.endswith("deploy/install.sh") for _, s in scripts), "Containerfile",
            "no RUN of deploy/install.sh")
    for n, s in sorted(scripts):
        path = os.path.join(src, s)
        p.check(os.path.isfile(path) and os.access(path, os.X_OK), "Containerfile:%d" % n,
                "%s is not an executable file of the repository" % s)
    install = os.path.join(src, "deploy", "install.sh")
    run_sh = os.path.join(src, "run.sh")
    p.check(os.access(run_sh, os.X_OK), "deploy/install.sh", "./run.sh is not executable")
    with open(install, encoding="utf-8") as f:
        install_text = f.read()
    with open(run_sh, encoding="utf-8") as f:
        run_text = f.read()
    p.check("./run.sh serve --version" in install_text, "deploy/install.sh",
            "does not build through ./run.sh serve --version")
    # That call relies on run.sh's serve building tensord into build-serve and handing the extra
    # arguments to it, and on tensord --version exiting at once (else the build would start a
    # server and never return).
    serve = re.search(r"\nserve\)\n(.*?)\n    ;;", run_text, re.S)
    if p.check(serve, "run.sh", "no serve) case"):
        body = serve.group(1)
        p.check("BUILD_TARGET=tensord build build-serve" in body, "run.sh serve",
                "no longer builds tensord into build-serve")
        p.check(re.search(r'exec build-serve/server/tensord [^\n]*"\$@"', body), "run.sh serve",
                "no longer execs build-serve/server/tensord with the extra arguments")
    v = subprocess.run([tensord, "--port", "8000", "--version"], **CAPTURE,
                       timeout=TOOL_TIMEOUT_S)
    p.check(v.returncode == 0 and v.stdout.startswith("tensord "), "tensord --version",
            "exited %d with %r" % (v.returncode, v.stdout))
    p.check(os.path.isfile(os.path.join(src, "deploy", "Containerfile.dockerignore")),
            "deploy", "no Containerfile.dockerignore (the build context would hold build/)")

    # The final stage: non-root numeric user, the two ports, an exec-form entry point and a
    # health check on the HTTP port, and the packages of every library tensord and tsctl load.
    final = [(n, i, rest) for n, i, rest in ins if n >= final_start]
    users = [rest for _, i, rest in final if i == "USER"]
    p.check(users and re.fullmatch(r"[1-9][0-9]*(:[0-9]+)?", users[-1]), "Containerfile",
            "the final stage's USER is not a numeric non-root uid")
    expose = " ".join(rest for _, i, rest in final if i == "EXPOSE").split()
    cmd = next((containerfile_exec_form(rest) for _, i, rest in final if i == "CMD"), None) or []
    entry = next((containerfile_exec_form(rest) for _, i, rest in final if i == "ENTRYPOINT"),
                 None)
    p.check(entry == ["tensord"], "Containerfile", "ENTRYPOINT is not [\"tensord\"]")
    for flag in ("--port", "--http-port"):
        val = arg_value(cmd, flag)
        p.check(val in expose, "Containerfile", "%s %s is not EXPOSEd (%s)" % (flag, val, expose))
    hc = [rest for _, i, rest in final if i == "HEALTHCHECK"]
    p.check(hc and arg_value(cmd, "--http-port") and
            ("/%s " % arg_value(cmd, "--http-port")) in hc[0] and "/healthz" in hc[0],
            "Containerfile", "no HEALTHCHECK on --http-port's /healthz")
    apt = " ".join(rest for _, i, rest in final if i == "RUN")
    m = re.search(r"apt-get install ([^&]*)", apt)
    installed = set(w for w in (m.group(1).split() if m else []) if not w.startswith("-"))
    for binary in (tensord, tsctl) if not SANITIZE else ():
        pkgs = runtime_packages(binary)
        if pkgs is None:
            print("ldd or dpkg cannot name the packages of %s: that part is skipped" % binary)
            continue
        for pkg in sorted(pkgs):
            p.check(pkg in installed, "Containerfile",
                    "%s loads a library of %s, which the final stage does not install"
                    % (os.path.basename(binary), pkg))
    return p.finish("containerfile")


# ---------------------------------------------------------------------------------------------
# cluster


def k8s_expand(s, env):
    """Kubernetes' $(VAR) expansion of command and args: $$ is a literal $, $(NAME) is the
    variable when the container defines it and stays as written otherwise."""
    out = []
    i = 0
    while i < len(s):
        if s[i] == "$" and i + 1 < len(s):
            if s[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if s[i + 1] == "(":
                j = s.find(")", i + 2)
                if j >= 0:
                    name = s[i + 2:j]
                    out.append(env[name] if name in env else s[i:j + 1])
                    i = j + 1
                    continue
        out.append(s[i])
        i += 1
    return "".join(out)


# Slots: the 16384 of them, and the function docs/PROTOCOL.md section 14 defines, written here
# again so that the check does not trust the code it checks.
SLOTS = 16384


def slot_of(name):
    """CRC-16/XMODEM of the name's hash tag (between the first { and the next }, when not
    empty) or of the whole name, mod 16384."""
    key = name
    a = name.find("{")
    if a >= 0:
        b = name.find("}", a + 1)
        if b > a + 1:
            key = name[a + 1:b]
    # binascii.crc_hqx with 0 as the start value is CRC-16/XMODEM (polynomial 0x1021).
    return binascii.crc_hqx(key.encode(), 0) % SLOTS


def name_of_shard(i, n):
    """A bin name whose slot shard i of n owns under the default split."""
    lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n - 1
    for k in range(100000):
        name = "deploy-check-%d" % k
        if lo <= slot_of(name) <= hi:
            return name
    raise SystemExit("no name found for shard %d of %d" % (i, n))


def http_get(port, path, timeout=3.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


def wait_http(port, path, proc, seconds):
    end = time.monotonic() + seconds
    last = None
    while time.monotonic() < end:
        if proc.poll() is not None:
            return "exited %d" % proc.returncode
        try:
            status, _ = http_get(port, path, timeout=1.0)
            if status == 200:
                return None
            last = "status %d" % status
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    return "no 200 in %.0f s (%s)" % (seconds, last)


def check_cluster(src, tensord, tsctl):
    need_yaml()
    p = cluster_once(src, tensord, tsctl)
    if p.items and p.port_taken:
        # The ports were free when picked, but another program took one before tensord bound
        # it: once more, with other ports.
        print("a port was taken before tensord bound it: again with other ports")
        p = cluster_once(src, tensord, tsctl)
    return p.finish("cluster")


def cluster_once(src, tensord, tsctl):
    """One start of the shards as the StatefulSet says; the Problems found (not finished)."""
    p = Problems()
    p.port_taken = False
    kube = Kube(src)
    sts = kube.statefulset()
    c = kube.container()
    replicas = sts["spec"]["replicas"]
    pod = sts["spec"]["template"]["spec"]
    script, arg0 = container_script(c)
    if not p.check(script, STS_FILE, "no sh -c wrapper"):
        return p
    mounts = {m["name"]: m["mountPath"] for m in c.get("volumeMounts", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    limit = parse_quantity(c["resources"]["limits"]["memory"])
    port_names = {pt["name"]: pt["containerPort"] for pt in c.get("ports", [])}
    svc = sts["spec"]["serviceName"]
    ns = kube.kustomization["namespace"]
    token = "deploy-check-token-0123456789abcdef"

    # Ports: one protocol port and one HTTP port per shard, free now (bound and released).
    ports = [free_port() for _ in range(replicas)]
    http_ports = [free_port() for _ in range(replicas)]
    procs = []
    specs = []  # each shard's command and environment, to restart it
    changes = {}  # bin name -> its change counter after the first PUT
    with tempfile.TemporaryDirectory(prefix="ts-deploy-cluster-") as tmp:
        try:
            for i in range(replicas):
                root = os.path.join(tmp, "pod%d" % i)
                paths = {}
                for name, mp in mounts.items():
                    d = os.path.join(root, name)
                    os.makedirs(d, 0o700)
                    paths[mp] = d
                    v = volumes.get(name, {})
                    if "configMap" in v:
                        cm = kube.configmap(v["configMap"]["name"])
                        for key, text in cm.get("data", {}).items():
                            # The shards' DNS names become this machine's ports.
                            for j in range(replicas):
                                text = text.replace(
                                    "%s-%d.%s.%s.svc.cluster.local:%d" % (
                                        sts["metadata"]["name"], j, svc, ns,
                                        port_names["tensorshare"]),
                                    "127.0.0.1:%d" % ports[j])
                            with open(os.path.join(d, key), "w") as f:
                                f.write(text)
                    if "secret" in v:
                        with open(os.path.join(d, "token"), "w") as f:
                            f.write(token + "\n")
                        os.chmod(os.path.join(d, "token"), v["secret"].get("defaultMode", 0o400))
                env = {
                    "PATH": os.path.dirname(os.path.abspath(tensord)) + ":" +
                    os.environ.get("PATH", "/usr/bin:/bin"),
                    "POD_NAME": "%s-%d" % (sts["metadata"]["name"], i),
                    # Shard 0 as on a Kubernetes without the pod-index label (the fallback).
                    "POD_INDEX": "" if i == 0 else str(i),
                    "MEMORY_LIMIT": str(limit),
                }
                for k in ("ASAN_OPTIONS", "UBSAN_OPTIONS", "LSAN_OPTIONS"):
                    if k in os.environ:
                        env[k] = os.environ[k]
                args = [k8s_expand(a, env) for a in c.get("args", [])]
                for j, a in enumerate(args):
                    for mp, d in paths.items():
                        if a.startswith(mp.rstrip("/") + "/"):
                            args[j] = d + a[len(mp.rstrip("/")):]
                for flag, val in (("--host", "127.0.0.1"), ("--port", str(ports[i])),
                                  ("--http-port", str(http_ports[i]))):
                    if flag in args:
                        args[args.index(flag) + 1] = val
                cmd = [k8s_expand(x, env) for x in c["command"]] + args
                log = open(os.path.join(tmp, "shard%d.log" % i), "w")
                specs.append((cmd, env))
                procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log,
                                               cwd=root), log, root))
            for i, (proc, _, _) in enumerate(procs):
                for path in ("/healthz", "/readyz"):
                    err = wait_http(http_ports[i], path, proc, PROCESS_WAIT_S)
                    p.check(err is None, "shard %d %s" % (i, path), str(err))
                try:
                    status, body = http_get(http_ports[i], "/metrics")
                    p.check(status == 200 and "tensord_" in body, "shard %d /metrics" % i,
                            "status %d, no tensord_ metric" % status)
                except OSError as e:
                    p.add("shard %d /metrics" % i, str(e))
                tenv = dict(os.environ, TS_AUTH_TOKEN=token)
                r = subprocess.run([tsctl, "-p", str(ports[i]), "-t", "5000", "ping"], env=tenv,
                                   **CAPTURE, timeout=TOOL_TIMEOUT_S)
                p.check(r.returncode == 0, "shard %d tsctl ping" % i, r.stderr.strip())
                # The shard took the index the pod gave it, and its map names the others: a bin
                # of shard i is stored there, and the next shard refuses it naming shard i's
                # address (the map line the ConfigMap gave, with this machine's port).
                name = name_of_shard(i, replicas)
                r = subprocess.run([tsctl, "-p", str(ports[i]), "-t", "5000", "put", name, "1"],
                                   env=tenv, **CAPTURE,
                                   timeout=TOOL_TIMEOUT_S)
                p.check(r.returncode == 0, "shard %d put %s" % (i, name), r.stderr.strip())
                m = re.search(r"change (\d+)", r.stdout)
                if m:
                    changes[name] = int(m.group(1))
                other = (i + 1) % replicas
                r = subprocess.run([tsctl, "-p", str(ports[other]), "-t", "5000", "put", name,
                                    "1"], env=tenv, **CAPTURE,
                                   timeout=TOOL_TIMEOUT_S)
                p.check(r.returncode != 0 and "WRONGSHARD" in r.stderr and
                        "127.0.0.1:%d" % ports[i] in r.stderr,
                        "shard %d put %s" % (other, name),
                        "not refused as shard %d's bin: %s" % (i, (r.stdout + r.stderr).strip()))
            # A restart of the last shard as a rolling update does it: SIGTERM, a clean exit,
            # the same command again. Its bin comes back from the snapshot on its volume, and
            # the bin's change counter keeps growing.
            last = replicas - 1
            proc, log, root = procs[last]
            rc = stop_process(proc)
            p.check(rc == 0, "shard %d" % last, "exited %r after SIGTERM (restart)" % rc)
            cmd, env = specs[last]
            procs[last] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=root),
                           log, root)
            err = wait_http(http_ports[last], "/readyz", procs[last][0], PROCESS_WAIT_S)
            p.check(err is None, "shard %d /readyz after a restart" % last, str(err))
            name = name_of_shard(last, replicas)
            tenv = dict(os.environ, TS_AUTH_TOKEN=token)
            r = subprocess.run([tsctl, "-p", str(ports[last]), "-t", "5000", "peek", name],
                               env=tenv, **CAPTURE, timeout=TOOL_TIMEOUT_S)
            p.check(r.returncode == 0, "shard %d peek %s after a restart" % (last, name),
                    "the bin did not survive the restart: %s" % r.stderr.strip())
            r = subprocess.run([tsctl, "-p", str(ports[last]), "-t", "5000", "put", name, "2"],
                               env=tenv, **CAPTURE, timeout=TOOL_TIMEOUT_S)
            m = re.search(r"change (\d+)", r.stdout)
            p.check(m and name in changes and int(m.group(1)) > changes[name],
                    "shard %d put %s after a restart" % (last, name),
                    "change counter not above %s: %s" % (changes.get(name), r.stdout.strip()))
            # The Containerfile's HEALTHCHECK, pointed at shard 0's HTTP port.
            hc = [rest for _, ins, rest in containerfile_instructions(src)
                  if ins == "HEALTHCHECK"]
            if p.check(hc, "Containerfile", "no HEALTHCHECK"):
                arr = containerfile_exec_form(hc[0].split(" CMD ", 1)[1])
                arr = [a.replace("/9100 ", "/%d " % http_ports[0]) for a in arr]
                r = subprocess.run(arr, **CAPTURE, timeout=TOOL_TIMEOUT_S)
                p.check(r.returncode == 0, "Containerfile HEALTHCHECK",
                        "exited %d against a running tensord: %s" % (r.returncode, r.stderr))
        finally:
            for i, (proc, log, root) in enumerate(procs):
                rc = stop_process(proc)
                log.close()
                p.check(rc == 0, "shard %d" % i, "exited %r after SIGTERM" % rc)
                snap = arg_value(c.get("args", []), "--save")
                if snap and rc == 0:
                    mp = next(m for m in mounts.values() if snap.startswith(m.rstrip("/") + "/"))
                    name = next(n for n, m in mounts.items() if m == mp)
                    p.check(os.path.isfile(os.path.join(root, name, snap[len(mp) + 1:])),
                            "shard %d" % i, "no snapshot written at shutdown")
            if p.items:
                for i in range(len(procs)):
                    with open(os.path.join(tmp, "shard%d.log" % i)) as f:
                        text = f.read()
                    p.port_taken = p.port_taken or "address already in use" in text.lower()
                    print("--- shard %d log ---\n%s" % (i, text[-3000:]))
    return p


# ---------------------------------------------------------------------------------------------
# selftest

# (check, file, text, replacement, expected words of a problem, needs strace): each breaks one
# thing the checks exist for.
SELFTEST_CASES = [
    ("manifests", "deploy/kubernetes/service.yaml", "component: shard\n  ports:",
     "component: shardx\n  ports:", "selector does not match", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "serviceName: tensord\n",
     "serviceName: tensord-metrics\n", "not a headless Service", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml",
     "path: /readyz\n              port: metrics", "path: /readyz\n              port: metric",
     "not a named container port", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "- name: token\n              mountPath",
     "- name: tokens\n              mountPath", "names no volume", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "replicas: 3", "replicas: 4",
     "replicas", False),
    ("manifests", "deploy/kubernetes/kustomization.yaml", "namespace: tensorshare",
     "namespace: ml", "line 0 is", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "- --save-interval",
     "- --save-intervall", "--save-intervall is not in", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "MEMORY_LIMIT / 4 * 3",
     "MEMORY_LIMIT / 10 * 9", "leaves less than", False),
    ("manifests", "deploy/kubernetes/statefulset.yaml", "readOnlyRootFilesystem: true",
     "readOnlyRootFilesystem: false", "readOnlyRootFilesystem", False),
    ("manifests", "deploy/systemd/tensord.service", "--unix /run", "--unix-socket /run",
     "--unix-socket is not in", False),
    ("manifests", "deploy/Containerfile", '"--save-interval", "60"', '"--save-every", "60"',
     "--save-every is not in", False),
    ("manifests", "docs/DEPLOY.md", "--max-memory 3g", "--max-memroy 3g", "--max-memroy", False),
    ("systemd", "deploy/systemd/tensord.service", "LockPersonality=yes", "LockPersonalty=yes",
     "Unknown key", False),
    ("systemd", "deploy/systemd/tensord.service", "--save /var/lib/tensord/",
     "--save /var/lib/tensorsave/", "StateDirectory", False),
    ("systemd", "deploy/systemd/tensord.service", "SystemCallFilter=~@privileged",
     "SystemCallFilter=~@privileged memfd_create", "tensord calls memfd_create", True),
    ("containerfile", "deploy/Containerfile", "libuv1 liblz4-1", "liblz4-1", "libuv1", False),
    ("cluster", "deploy/kubernetes/statefulset.yaml", "i=${POD_NAME##*-}", "i=1",
     "shard 0 put", False),
    ("containerfile", "deploy/Containerfile", "EXPOSE 8000 9100", "EXPOSE 8000",
     "not EXPOSEd", False),
    ("containerfile", "deploy/Containerfile", "deploy/install.sh /opt", "deploy/build.sh /opt",
     "not an executable file", False),
    ("containerfile", "run.sh", 'exec build-serve/server/tensord --port 8000 "$@"',
     "exec build-serve/server/tensord --port 8000", "extra arguments", False),
]


def selftest(src, tensord, tsctl):
    global STRACE_ENABLED
    have = {"systemd": shutil.which("systemd-analyze") is not None,
            "strace": shutil.which("strace") is not None}
    p = Problems()
    for check, rel, old, new, expect, strace in SELFTEST_CASES:
        if check == "systemd" and not have["systemd"] or strace and not have["strace"]:
            print("skipped (no tool): %s %s" % (check, rel))
            continue
        if SANITIZE and (strace or "libuv1" in expect):
            print("skipped (a sanitizer build): %s %s" % (check, rel))
            continue
        with tempfile.TemporaryDirectory(prefix="ts-deploy-self-") as tmp:
            shutil.copytree(os.path.join(src, "deploy"), os.path.join(tmp, "deploy"))
            os.mkdir(os.path.join(tmp, "docs"))
            shutil.copy2(os.path.join(src, "docs", "DEPLOY.md"), os.path.join(tmp, "docs"))
            shutil.copy2(os.path.join(src, "run.sh"), tmp)
            path = os.path.join(tmp, rel)
            with open(path, encoding="utf-8") as f:
                text = f.read()
            where = "%s: %r -> %r" % (rel, old, new)
            if not p.check(old in text, where, "the text to break is not in the file"):
                continue
            with open(path, "w", encoding="utf-8") as f:
                f.write(text.replace(old, new, 1))
            out = io.StringIO()
            STRACE_ENABLED = strace
            try:
                with contextlib.redirect_stdout(out):
                    fn = {"manifests": check_manifests, "systemd": check_systemd,
                          "containerfile": check_containerfile, "cluster": check_cluster}[check]
                    rc = fn(tmp, tensord, tsctl)
            finally:
                STRACE_ENABLED = True
            hit = [ln for ln in out.getvalue().splitlines()
                   if ln.startswith("FAIL ") and expect in ln]
            p.check(rc == 1 and hit, where, "check %s did not report %r" % (check, expect))
            if hit:
                print("caught by %s: %s" % (check, hit[0][5:]))
    return p.finish("selftest")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("check", choices=["manifests", "kustomize", "systemd", "containerfile",
                                      "cluster", "selftest"])
    ap.add_argument("--source", required=True, help="the repository's root")
    ap.add_argument("--tensord", required=True, help="the built tensord")
    ap.add_argument("--tsctl", required=True, help="the built tsctl")
    ap.add_argument("--sanitize", default="", help="the build's sanitizers (TS_SANITIZE)")
    a = ap.parse_args()
    global SANITIZE
    SANITIZE = a.sanitize
    src = os.path.abspath(a.source)
    a.tensord = os.path.abspath(a.tensord)
    a.tsctl = os.path.abspath(a.tsctl)
    if a.check == "manifests":
        return check_manifests(src, a.tensord, a.tsctl)
    if a.check == "kustomize":
        return check_kustomize(src)
    if a.check == "systemd":
        return check_systemd(src, a.tensord, a.tsctl)
    if a.check == "containerfile":
        return check_containerfile(src, a.tensord, a.tsctl)
    if a.check == "selftest":
        return selftest(src, a.tensord, a.tsctl)
    return check_cluster(src, a.tensord, a.tsctl)


if __name__ == "__main__":
    sys.exit(main())
