// A device plugin for the real-node test (tests/node): it speaks the kubelet's device-plugin API
// (k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1, gRPC) the way NVIDIA's k8s-device-plugin does with
// time-slicing and the envvar device-list strategy, for GPUs that are not there: stand-in device
// nodes (null devices under NVIDIA's names) in --dev-dir.
//
// Devices: GPU i (0 <= i < --gpus) has the UUID <--uuid-prefix><i as %08d><--uuid-suffix> (the
// defaults give tests/nvml_stub/scenarios/h200x8.json's GPU-0000000i-1111-2222-3333-444444444444).
// With --replicas 1 the plugin advertises each UUID as it is (NVIDIA's plugin without sharing);
// with --replicas R > 1 it advertises R IDs per GPU, <uuid>::<k> for k = 0..R-1 (NVIDIA's
// AnnotatedID, internal/rm/devices.go). All are Healthy, no topology.
//
// Allocate answers, per container: env NVIDIA_VISIBLE_DEVICES=<the distinct UUIDs, comma-separated,
// in request order>, and device specs /dev/nvidia<i> (host <dev-dir>/nvidia<i>) for each distinct
// GPU, then /dev/nvidiactl and /dev/nvidia-uvm, permissions "rw". An unknown ID fails the call.
//
// Lifecycle: waits for --kubelet-socket, serves <plugin-dir>/<endpoint> and registers. The kubelet
// removes every socket in its device-plugins directory when it starts, so the plugin polls: when
// kubelet.sock is a new file (another inode or mtime) or its own socket has gone, it serves a
// fresh socket and registers again. SIGTERM/SIGINT: stop serving, remove the socket, exit 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/debug"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	api.UnimplementedDevicePluginServer
	gpus     []string // UUID by index
	ids      []string // advertised device IDs
	byID     map[string]int
	devDir   string
	stop     chan struct{} // closed when this serving generation ends
	stopOnce sync.Once
}

func gpuUUID(prefix, suffix string, i int) string {
	return fmt.Sprintf("%s%08d%s", prefix, i, suffix)
}

func newPlugin(gpus, replicas int, prefix, suffix, devDir string) *plugin {
	p := &plugin{byID: map[string]int{}, devDir: devDir, stop: make(chan struct{})}
	for i := range gpus {
		u := gpuUUID(prefix, suffix, i)
		p.gpus = append(p.gpus, u)
		if replicas == 1 {
			p.ids = append(p.ids, u)
			p.byID[u] = i
			continue
		}
		for k := range replicas {
			id := fmt.Sprintf("%s::%d", u, k)
			p.ids = append(p.ids, id)
			p.byID[id] = i
		}
	}
	return p
}

func (p *plugin) GetDevicePluginOptions(
	context.Context, *api.Empty,
) (*api.DevicePluginOptions, error) {
	return &api.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(
	_ *api.Empty, s grpc.ServerStreamingServer[api.ListAndWatchResponse],
) error {
	resp := &api.ListAndWatchResponse{}
	for _, id := range p.ids {
		resp.Devices = append(resp.Devices, &api.Device{ID: id, Health: api.Healthy})
	}
	if err := s.Send(resp); err != nil {
		return err
	}
	log.Printf("ListAndWatch: advertised %d devices", len(resp.Devices))
	select { // the list never changes: hold the stream open until either side ends it
	case <-s.Context().Done():
	case <-p.stop:
	}
	return nil
}

func (p *plugin) GetPreferredAllocation(
	context.Context, *api.PreferredAllocationRequest,
) (*api.PreferredAllocationResponse, error) {
	return &api.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(
	_ context.Context, req *api.AllocateRequest,
) (*api.AllocateResponse, error) {
	resp := &api.AllocateResponse{}
	for _, creq := range req.ContainerRequests {
		var uuids []string
		var specs []*api.DeviceSpec
		seen := map[int]bool{}
		for _, id := range creq.DevicesIds {
			i, ok := p.byID[id]
			if !ok {
				return nil, fmt.Errorf("unknown device %q", id)
			}
			if seen[i] {
				continue
			}
			seen[i] = true
			uuids = append(uuids, p.gpus[i])
			specs = append(specs, p.spec(fmt.Sprintf("nvidia%d", i)))
		}
		specs = append(specs, p.spec("nvidiactl"), p.spec("nvidia-uvm"))
		visible := strings.Join(uuids, ",")
		log.Printf("Allocate %v -> NVIDIA_VISIBLE_DEVICES=%s", creq.DevicesIds, visible)
		resp.ContainerResponses = append(resp.ContainerResponses, &api.ContainerAllocateResponse{
			Envs:    map[string]string{"NVIDIA_VISIBLE_DEVICES": visible},
			Devices: specs,
		})
	}
	return resp, nil
}

func (p *plugin) spec(name string) *api.DeviceSpec {
	return &api.DeviceSpec{
		ContainerPath: "/dev/" + name, HostPath: filepath.Join(p.devDir, name), Permissions: "rw",
	}
}

func (p *plugin) PreStartContainer(
	context.Context, *api.PreStartContainerRequest,
) (*api.PreStartContainerResponse, error) {
	return &api.PreStartContainerResponse{}, nil
}

// serve listens on sock (replacing a stale file) and serves p until the returned server stops.
func serve(p *plugin, sock string) (*grpc.Server, error) {
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer()
	api.RegisterDevicePluginServer(srv, p)
	go func() {
		if err := srv.Serve(ln); err != nil {
			log.Printf("serve %s: %v", sock, err)
		}
	}()
	return srv, nil
}

func register(kubeletSock, endpoint, resource string) error {
	conn, err := grpc.NewClient("unix://"+kubeletSock,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = api.NewRegistrationClient(conn).Register(ctx, &api.RegisterRequest{
		Version: api.Version, Endpoint: endpoint, ResourceName: resource,
		Options: &api.DevicePluginOptions{},
	})
	return err
}

// fileID identifies one incarnation of a file; "" when it is absent.
func fileID(path string) string {
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return ""
	}
	return fmt.Sprintf("%d:%d:%d", st.Ino, st.Mtim.Sec, st.Mtim.Nsec)
}

func printVersion() {
	line := "gpu-device-plugin (gpuguard real-node test) deviceplugin/" + api.Version
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, d := range bi.Deps {
			if d.Path == "k8s.io/kubelet" || d.Path == "google.golang.org/grpc" {
				line += " " + d.Path + "@" + d.Version
			}
		}
	}
	fmt.Println(line)
}

func main() {
	kubeletSock := flag.String("kubelet-socket", api.KubeletSocket,
		"the kubelet's registration socket (hard-coded in the kubelet: "+api.KubeletSocket+")")
	pluginDir := flag.String("plugin-dir", "",
		"where this plugin's socket goes; must be the kubelet's device-plugins directory "+
			"(default: the directory of --kubelet-socket)")
	endpoint := flag.String("endpoint", "gpuguard-test-gpu.sock", "this plugin's socket name")
	resource := flag.String("resource", "nvidia.com/gpu", "extended resource name")
	gpus := flag.Int("gpus", 1, "number of GPUs")
	replicas := flag.Int("replicas", 1, "time-slicing replicas per GPU")
	prefix := flag.String("uuid-prefix", "GPU-", "GPU i's UUID is <prefix><i as %08d><suffix>")
	suffix := flag.String("uuid-suffix", "-1111-2222-3333-444444444444", "see --uuid-prefix")
	devDir := flag.String("dev-dir", "/dev", "host directory of nvidia<i>, nvidiactl, nvidia-uvm")
	poll := flag.Duration("poll", time.Second, "how often to check for a restarted kubelet")
	version := flag.Bool("version", false, "print the API modules' versions and exit")
	flag.Parse()
	if *version {
		printVersion()
		return
	}
	log.SetFlags(log.LstdFlags | log.Lmicroseconds)
	if *gpus < 1 || *replicas < 1 || flag.NArg() != 0 {
		log.Fatalf("need --gpus >= 1 and --replicas >= 1, no arguments (got %v)", flag.Args())
	}
	if *pluginDir == "" {
		*pluginDir = filepath.Dir(*kubeletSock)
	}
	if strings.Contains(*endpoint, "/") {
		log.Fatalf("--endpoint %q: a file name in --plugin-dir, not a path", *endpoint)
	}
	sock := filepath.Join(*pluginDir, *endpoint)

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(*poll)
	defer tick.Stop()

	var srv *grpc.Server
	var cur *plugin
	stopServing := func() {
		if srv != nil {
			cur.stopOnce.Do(func() { close(cur.stop) })
			srv.Stop()
			srv = nil
		}
	}
	registered := ""
	for {
		if k := fileID(*kubeletSock); k != "" && (k != registered || fileID(sock) == "") {
			stopServing()
			cur = newPlugin(*gpus, *replicas, *prefix, *suffix, *devDir)
			s, err := serve(cur, sock)
			if err != nil {
				log.Printf("serve %s: %v", sock, err)
			} else if err := register(*kubeletSock, *endpoint, *resource); err != nil {
				log.Printf("register with %s: %v (retrying)", *kubeletSock, err)
				srv = s
				stopServing()
			} else {
				srv, registered = s, k
				log.Printf("registered %s: %d devices (%d GPUs x %d) at %s",
					*resource, len(cur.ids), *gpus, *replicas, sock)
			}
		}
		select {
		case sig := <-sigs:
			log.Printf("%v: stopping", sig)
			stopServing()
			if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
				log.Printf("remove %s: %v", sock, err)
			}
			return
		case <-tick.C:
		}
	}
}
