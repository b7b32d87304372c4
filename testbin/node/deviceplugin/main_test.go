package main

// The plugin against a stand-in kubelet registration server: register, ListAndWatch, Allocate,
// re-register after a kubelet restart (kubelet.sock recreated, the plugin's socket removed as the
// kubelet's CleanupPluginDirectory does), SIGTERM. The test runs this test binary as the plugin
// (GPUGUARD_DP_MAIN=1 makes TestMain call main).
//
//	cd testbin/node/deviceplugin && go test .

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func TestMain(m *testing.M) {
	if os.Getenv("GPUGUARD_DP_MAIN") == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

type fakeKubelet struct {
	api.UnimplementedRegistrationServer
	got chan *api.RegisterRequest
}

func (k *fakeKubelet) Register(_ context.Context, r *api.RegisterRequest) (*api.Empty, error) {
	k.got <- r
	return &api.Empty{}, nil
}

func startKubelet(t *testing.T, sock string) (*grpc.Server, chan *api.RegisterRequest) {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKubelet{got: make(chan *api.RegisterRequest, 4)}
	srv := grpc.NewServer()
	api.RegisterRegistrationServer(srv, k)
	go func() { _ = srv.Serve(ln) }()
	return srv, k.got
}

func waitRegister(t *testing.T, got chan *api.RegisterRequest) *api.RegisterRequest {
	t.Helper()
	select {
	case r := <-got:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no Register within 10 s")
		return nil
	}
}

func TestPlugin(t *testing.T) {
	dir := t.TempDir()
	kubeletSock := filepath.Join(dir, "kubelet.sock")
	srv, got := startKubelet(t, kubeletSock)
	cmd := exec.Command(os.Args[0], "--kubelet-socket", kubeletSock, "--gpus", "2",
		"--replicas", "3", "--dev-dir", "/devs", "--poll", "100ms")
	cmd.Env = append(os.Environ(), "GPUGUARD_DP_MAIN=1")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill() }()

	r := waitRegister(t, got)
	want := &api.RegisterRequest{Version: "v1beta1", Endpoint: "gpuguard-test-gpu.sock",
		ResourceName: "nvidia.com/gpu", Options: &api.DevicePluginOptions{}}
	if r.Version != want.Version || r.Endpoint != want.Endpoint ||
		r.ResourceName != want.ResourceName {
		t.Fatalf("Register %v, want %v", r, want)
	}
	sock := filepath.Join(dir, r.Endpoint)
	conn, err := grpc.NewClient("unix://"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := api.NewDevicePluginClient(conn)
	ctx := context.Background()
	stream, err := c.ListAndWatch(ctx, &api.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	lw, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	u0 := "GPU-00000000-1111-2222-3333-444444444444"
	u1 := "GPU-00000001-1111-2222-3333-444444444444"
	var ids []string
	for _, d := range lw.Devices {
		if d.Health != api.Healthy {
			t.Errorf("%s: %s", d.ID, d.Health)
		}
		ids = append(ids, d.ID)
	}
	wantIDs := []string{u0 + "::0", u0 + "::1", u0 + "::2", u1 + "::0", u1 + "::1", u1 + "::2"}
	if !reflect.DeepEqual(ids, wantIDs) {
		t.Fatalf("advertised %v, want %v", ids, wantIDs)
	}

	a, err := c.Allocate(ctx, &api.AllocateRequest{ContainerRequests: []*api.ContainerAllocateRequest{
		{DevicesIds: []string{u1 + "::2", u0 + "::1", u1 + "::0"}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	cr := a.ContainerResponses[0]
	if v := cr.Envs["NVIDIA_VISIBLE_DEVICES"]; v != u1+","+u0 {
		t.Errorf("NVIDIA_VISIBLE_DEVICES=%q", v)
	}
	var specs [][3]string
	for _, d := range cr.Devices {
		specs = append(specs, [3]string{d.ContainerPath, d.HostPath, d.Permissions})
	}
	wantSpecs := [][3]string{
		{"/dev/nvidia1", "/devs/nvidia1", "rw"}, {"/dev/nvidia0", "/devs/nvidia0", "rw"},
		{"/dev/nvidiactl", "/devs/nvidiactl", "rw"}, {"/dev/nvidia-uvm", "/devs/nvidia-uvm", "rw"},
	}
	if !reflect.DeepEqual(specs, wantSpecs) {
		t.Errorf("device specs %v, want %v", specs, wantSpecs)
	}
	_, err = c.Allocate(ctx, &api.AllocateRequest{ContainerRequests: []*api.ContainerAllocateRequest{
		{DevicesIds: []string{u0 + "::7"}},
	}})
	if err == nil {
		t.Error("Allocate of an unknown ID succeeded")
	}

	// A kubelet restart: its registration server goes, it removes every socket in the directory
	// and serves a new kubelet.sock.
	srv.Stop()
	_ = os.Remove(sock)
	_ = os.Remove(kubeletSock)
	srv2, got2 := startKubelet(t, kubeletSock)
	defer srv2.Stop()
	if r := waitRegister(t, got2); r.Endpoint != want.Endpoint {
		t.Fatalf("re-Register %v", r)
	}
	if _, err := os.Stat(sock); err != nil {
		t.Fatalf("no plugin socket after re-registering: %v", err)
	}

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("exit after SIGTERM: %v", err)
	}
	if _, err := os.Stat(sock); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("plugin socket left behind: %v", err)
	}
}
