/* The pod sandbox's pause process for the real-node tests (rigs/kubelet/node.py), built here
 * with `gcc -static -Os` instead of pulling registry.k8s.io/pause: the node runs without a
 * registry. Same contract as Kubernetes' build/pause/linux/pause.c: sleep forever as the
 * sandbox's PID 1, reap every child that gets reparented to it, exit 0 on SIGINT or SIGTERM. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void bye(int sig) {
  (void)sig;
  _exit(0);
}

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction stop = {.sa_handler = bye};
  struct sigaction child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
      sigaction(SIGCHLD, &child, NULL) < 0) {
    return 1;
  }
  for (;;) {
    pause();
  }
}
