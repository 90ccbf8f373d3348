"""Real hosts on one machine: network namespaces on a bridge, each with sshd.

    Hosts(["hvd-a", "hvd-b"], "10.77.0")        the suite's two hosts (fixture two_hosts)
    Hosts(["node1", ..., "node4"], "10.78.0")   its four-node cluster (fixture four_hosts)

    node1 10.78.0.1 --hvd0--+
    node2 10.78.0.2 --hvd0--+-- bridge (in a namespace of its own: the "switch")
    ...                     |

Each host has its own network stack, IP address and host name (a UTS
namespace), so mpirun and horovodrun treat the others as remote machines and
reach them over ssh, exactly as on a cluster; every host runs an sshd (a
launcher may reach its own host over ssh too). Commands run "on the first
host" through ``hosts.on_first(command)``; an ``ssh`` wrapper early on PATH uses
a private key and known-hosts file, so nothing in ~/.ssh is read or written.
A host's link can be taken down in its namespace (``hosts.link(name, "down")``):
its processes live on, its packets are lost, as in a network partition.
Two instances never meet (own namespaces, bridge and subnet), so their tests
may run side by side. Everything is removed at the end; every command has a
timeout.
"""
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .needs import require, require_program

INTERFACE = "hvd0"  # the same name on every host: horovodrun --network-interface wants one
SSHD = "/usr/sbin/sshd"
INSTALL_HINT = "apt-get install openssh-server openssh-client iproute2 util-linux (or `make setup` as root)"

SSHD_CONFIG = """\
ListenAddress {address}
Port 22
HostKey {root}/host_key
AuthorizedKeysFile {root}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
UseDNS no
StrictModes no
PidFile {root}/sshd.{name}.pid
LogLevel ERROR
"""

SSH_CONFIG = """\
Host *
  IdentityFile {root}/client_key
  IdentitiesOnly yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  BatchMode yes
  ConnectTimeout 10
  LogLevel ERROR
"""


def sh(command, timeout=20):
    result = subprocess.run([str(c) for c in command], timeout=timeout, stdin=subprocess.DEVNULL,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"$ {' '.join(map(str, command))} -> {result.returncode}\n{result.stderr}")
    return result.stdout


class Hosts:
    def __init__(self, names, subnet):
        self.addresses = {name: f"{subnet}.{i}" for i, name in enumerate(names, start=1)}
        self.names = list(names)
        tag = f"{os.getpid()}{subnet.split('.')[1]}"
        self.namespaces = {name: f"hvdtest{tag}{name}" for name in names}
        self.switch = f"hvdtest{tag}sw"
        self.root = Path(tempfile.mkdtemp(prefix="hvd-hosts-"))
        self.created = []  # what to remove, newest last
        self.sshd = []

    def start(self):
        try:
            self._network()
            self._hosts_files()
            self._ssh_keys_and_wrapper()
            self._start_sshd()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self):
        """A bridge in the switch's namespace; a veth pair from it to each host (named hvd0 there)."""
        for namespace in [self.switch, *self.namespaces.values()]:
            sh(["ip", "netns", "add", namespace])
            self.created.append(("netns", namespace))
        sh(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
        sh(["ip", "-n", self.switch, "link", "set", "br0", "up"])
        for i, (name, namespace) in enumerate(self.namespaces.items()):
            port, end = f"port{i}", f"host{i}"  # made in the switch's own namespace: no clash
            sh(["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", end])
            sh(["ip", "-n", self.switch, "link", "set", port, "master", "br0", "up"])
            sh(["ip", "-n", self.switch, "link", "set", end, "netns", namespace])
            sh(["ip", "-n", namespace, "link", "set", end, "name", INTERFACE])
            sh(["ip", "-n", namespace, "addr", "add", f"{self.addresses[name]}/24", "dev", INTERFACE])
            sh(["ip", "-n", namespace, "link", "set", INTERFACE, "up"])
            sh(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def link(self, name, state):
        """Take host ``name``'s link "down" (a partition: processes alive, packets lost) or "up"."""
        sh(["ip", "-n", self.namespaces[name], "link", "set", INTERFACE, state])

    def _hosts_files(self):
        """`ip netns exec` bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts."""
        # Shared by every instance, so never removed: one that stopped removed it under another's feet.
        Path("/etc/netns").mkdir(exist_ok=True)
        text = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in self.addresses.items())
        for namespace in self.namespaces.values():
            directory = Path("/etc/netns") / namespace
            directory.mkdir()
            self.created.append(("tree", str(directory)))
            (directory / "hosts").write_text(text)

    def _ssh_keys_and_wrapper(self):
        for key in ("host_key", "client_key"):
            sh(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", self.root / key])
        shutil.copy(self.root / "client_key.pub", self.root / "authorized_keys")
        (self.root / "ssh_config").write_text(SSH_CONFIG.format(root=self.root))
        self.bin = self.root / "bin"
        self.bin.mkdir()
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.root}/ssh_config "$@"\n')
        wrapper.chmod(0o755)

    def _start_sshd(self):
        # sshd's privilege separation directory, which it needs at every connection. Shared by every
        # instance (and a system sshd), so never removed: an instance that created it and stopped took
        # it from another instance still running, whose sshd then reset every connection.
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
        for name in self.names:
            config = self.root / f"sshd_config.{name}"
            config.write_text(SSHD_CONFIG.format(root=self.root, address=self.addresses[name], name=name))
            with open(self.root / f"sshd.{name}.log", "w") as log:
                self.sshd.append(subprocess.Popen(self.on(name, [SSHD, "-D", "-e", "-f", config]),
                                                  stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                  start_new_session=True))
        for name in self.names:
            self._wait_for_sshd(name)

    def _wait_for_sshd(self, name):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            probe = subprocess.run(self.on_first(["ssh", name, "hostname"]), env={**os.environ, **self.env()},
                                   capture_output=True, text=True, timeout=20)
            if probe.stdout.strip() == name:
                return
            time.sleep(0.5)
        raise RuntimeError(f"sshd on {name} did not answer:\n{(self.root / f'sshd.{name}.log').read_text()}")

    @contextlib.contextmanager
    def restored(self, name, marker, watcher):
        """For a test that cuts host ``name``'s link from ``watcher`` (a thread): on leaving,
        whatever happened, the watcher given a second to finish, the link up again and every
        process of ``marker`` on the host ended (cut off from the ssh that started them, they
        would outlive the job): the next tests find the hosts as they were."""
        try:
            yield
        finally:
            watcher.join(timeout=1)
            self.link(name, "up")
            self.vanish(name, marker)

    def vanish(self, name, marker):
        """Host ``name`` dies as a node does: every process of ``marker`` on it SIGKILLed at once."""
        _kill_in(self.namespaces[name], marker)

    @contextlib.contextmanager
    def named(self, host, name):
        """Host ``host`` reports the host name ``name`` meanwhile (a cloned VM, a container
        sharing its host's name): its sshd's UTS namespace, which what ssh starts there shares.
        The started process's pid is sshd's own: ``on`` ends in ``exec`` (ip netns exec, unshare
        and sh each exec the next), so the pid is in the namespace ``hostname`` changes."""
        sshd = self.sshd[self.names.index(host)]
        sh(["nsenter", "--target", sshd.pid, "--uts", "hostname", name])
        try:
            yield
        finally:
            sh(["nsenter", "--target", sshd.pid, "--uts", "hostname", host])

    def on(self, host, command):
        """``command`` run on ``host`` (its network namespace and host name)."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *[str(c) for c in command]]

    def on_first(self, command):
        return self.on(self.names[0], command)

    @staticmethod
    def mpirun(np, hostfile, pass_env=()):
        """mpirun's command line for ``np`` ranks over the hosts' own interface: no binding
        (one thread per rank), the test environment and ``pass_env`` handed to the ranks
        that ssh starts. With ``env()`` and OMPI_MCA_rmaps_base_oversubscribe=0, so
        that a hostfile's slots decide where each rank runs."""
        return ["mpirun", "-np", str(np), "-hostfile", hostfile, "--bind-to", "none",
                "-mca", "btl_tcp_if_include", INTERFACE, "-mca", "oob_tcp_if_include", INTERFACE,
                *[arg for name in ("PATH", "OMP_NUM_THREADS", "PYTHONUNBUFFERED", *pass_env) for arg in ("-x", name)]]

    def env(self):
        """Environment additions for commands on the hosts: the ssh wrapper, then the venv, first on PATH."""
        path = os.pathsep.join([str(self.bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {"PATH": path}

    def stop(self):
        # Our processes in the namespaces (sshd, orted, ranks started over ssh), by pid.
        for namespace in self.namespaces.values():
            _kill_in(namespace)
        for sshd in self.sshd:
            sshd.kill()
            sshd.wait(timeout=10)
        for kind, what in reversed(self.created):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", what], timeout=10, capture_output=True)
            elif kind == "tree":
                shutil.rmtree(what, ignore_errors=True)
        shutil.rmtree(self.root, ignore_errors=True)


def _kill_in(namespace, marker=""):
    """SIGKILL the processes in ``namespace`` whose command line holds ``marker`` (all for "")."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
    for pid in listed.stdout.split():
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(int(pid), 9)
        except (OSError, ValueError):
            pass  # gone meanwhile


def require_hosts():
    for program in ("ip", "ssh", "ssh-keygen", "unshare", "nsenter"):
        require_program(program, INSTALL_HINT)
    require(Path(SSHD).exists(), f"`{SSHD}`", INSTALL_HINT)
    require(os.geteuid() == 0, "root (network namespaces need it)", "run the multi-host tests as root, as CI does")


_OFFLINE = itertools.count()


@contextlib.contextmanager
def no_network():
    """A machine with no network: a namespace with only ``lo``. Yields the prefix that runs a
    command in it (``ip netns exec NAME``); its processes are killed when it is left."""
    namespace = f"hvdtest-offline-{os.getpid()}-{next(_OFFLINE)}"
    sh(["ip", "netns", "add", namespace])
    try:
        sh(["ip", "-n", namespace, "link", "set", "lo", "up"])
        yield ["ip", "netns", "exec", namespace]
    finally:
        _kill_in(namespace)
        subprocess.run(["ip", "netns", "del", namespace], timeout=10, capture_output=True)
