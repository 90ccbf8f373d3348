"""Two real hosts on one machine: network namespaces joined by a veth pair, sshd on the second.

    hvd-a 10.77.0.1  <-- veth "hvd0" -->  10.77.0.2 hvd-b (sshd)

Each "host" has its own network stack, IP address and host name (a UTS
namespace), so mpirun and horovodrun treat hvd-b as a remote machine and reach
it over ssh, exactly as on a cluster. Commands run "on hvd-a" through
``TwoHosts.on_a(command)``; an ``ssh`` wrapper early on PATH uses a private key
and known-hosts file, so nothing in ~/.ssh is read or written. Everything is
removed at the end; every command has a timeout.
"""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .needs import require, require_program

HOSTS = {"hvd-a": "10.77.0.1", "hvd-b": "10.77.0.2"}
INTERFACE = "hvd0"  # the same name on both hosts: horovodrun --network-interface wants one
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
PidFile {root}/sshd.pid
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


class TwoHosts:
    def __init__(self):
        tag = f"{os.getpid()}"
        self.namespaces = {"hvd-a": f"hvdtest{tag}a", "hvd-b": f"hvdtest{tag}b"}
        self.veth = (f"hv{tag}a"[-15:], f"hv{tag}b"[-15:])
        self.root = Path(tempfile.mkdtemp(prefix="hvd-hosts-"))
        self.created = []  # what to remove, newest last
        self.sshd = None

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
        for name, namespace in self.namespaces.items():
            sh(["ip", "netns", "add", namespace])
            self.created.append(("netns", namespace))
        sh(["ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1]])
        for (name, namespace), veth in zip(self.namespaces.items(), self.veth):
            sh(["ip", "link", "set", veth, "netns", namespace])
            sh(["ip", "-n", namespace, "link", "set", veth, "name", INTERFACE])
            sh(["ip", "-n", namespace, "addr", "add", f"{HOSTS[name]}/24", "dev", INTERFACE])
            sh(["ip", "-n", namespace, "link", "set", INTERFACE, "up"])
            sh(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def _hosts_files(self):
        """`ip netns exec` bind-mounts /etc/netns/<namespace>/hosts over /etc/hosts."""
        if not Path("/etc/netns").exists():
            Path("/etc/netns").mkdir()
            self.created.append(("dir", "/etc/netns"))
        text = "127.0.0.1 localhost\n" + "".join(f"{ip} {name}\n" for name, ip in HOSTS.items())
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
        (self.root / "sshd_config").write_text(SSHD_CONFIG.format(root=self.root, address=HOSTS["hvd-b"]))
        self.bin = self.root / "bin"
        self.bin.mkdir()
        wrapper = self.bin / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec /usr/bin/ssh -F {self.root}/ssh_config "$@"\n')
        wrapper.chmod(0o755)

    def _start_sshd(self):
        if not Path("/run/sshd").exists():  # sshd's privilege separation directory
            Path("/run/sshd").mkdir(mode=0o755)
            self.created.append(("dir", "/run/sshd"))
        log = open(self.root / "sshd.log", "w")
        self.sshd = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces["hvd-b"], "unshare", "--uts", "sh", "-c",
             f"hostname hvd-b && exec {SSHD} -D -e -f {self.root}/sshd_config"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            probe = subprocess.run(self.on_a(["ssh", "hvd-b", "hostname"]), env={**os.environ, **self.env()},
                                   capture_output=True, text=True, timeout=20)
            if probe.stdout.strip() == "hvd-b":
                return
            time.sleep(0.5)
        raise RuntimeError(f"sshd on hvd-b did not answer:\n{(self.root / 'sshd.log').read_text()}")

    def on(self, host, command):
        """``command`` run on ``host`` (its network namespace and host name)."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
                f'hostname {host} && exec "$@"', "sh", *[str(c) for c in command]]

    def on_a(self, command):
        return self.on("hvd-a", command)

    def env(self):
        """Environment additions for commands on the hosts: the ssh wrapper, then the venv, first on PATH."""
        path = os.pathsep.join([str(self.bin), str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return {"PATH": path}

    def stop(self):
        # Our processes in the namespaces (sshd, orted, ranks started over ssh), by pid.
        for namespace in self.namespaces.values():
            listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                                    timeout=10)
            for pid in listed.stdout.split():
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
        if self.sshd is not None:
            self.sshd.kill()
            self.sshd.wait(timeout=10)
        for kind, what in reversed(self.created):
            if kind == "netns":
                subprocess.run(["ip", "netns", "del", what], timeout=10, capture_output=True)
            elif kind == "tree":
                shutil.rmtree(what, ignore_errors=True)
            elif kind == "dir":
                try:
                    Path(what).rmdir()
                except OSError:
                    pass
        shutil.rmtree(self.root, ignore_errors=True)


def require_two_hosts():
    for program in ("ip", "ssh", "ssh-keygen", "unshare"):
        require_program(program, INSTALL_HINT)
    require(Path(SSHD).exists(), f"`{SSHD}`", INSTALL_HINT)
    require(os.geteuid() == 0, "root (network namespaces need it)", "run the two-host tests as root, as CI does")
