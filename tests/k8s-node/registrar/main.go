// Command registrar registers a CSI node plugin with the kubelet through the
// kubelet's plugin-registration socket, the job node-driver-registrar does in
// the DaemonSet (that module is not served by the module proxy here).
//
// It asks the plugin for its name (CSI GetPluginInfo), serves the
// pluginregistration v1 Registration service on
// <registration-dir>/<name>-reg.sock, and exits non-zero when the kubelet
// reports a failed registration.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	csi "github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

type server struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	failed         chan string
}

func (s *server) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              s.name,
		Endpoint:          s.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (s *server) NotifyRegistrationStatus(_ context.Context, st *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if st.PluginRegistered {
		log.Printf("registered with the kubelet")
	} else {
		log.Printf("kubelet refused the registration: %s", st.Error)
		select {
		case s.failed <- st.Error:
		default:
		}
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// pluginName asks the CSI plugin at addr for its name, retrying (bounded) until it answers.
func pluginName(addr string, timeout time.Duration) (string, error) {
	conn, err := grpc.NewClient("unix://"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		resp, err := csi.NewIdentityClient(conn).GetPluginInfo(ctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil {
			return resp.GetName(), nil
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("GetPluginInfo on %s: %w", addr, err)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func main() {
	csiAddr := flag.String("csi-address", "", "the CSI plugin's socket as this process sees it")
	regPath := flag.String("kubelet-registration-path", "", "the CSI plugin's socket as the kubelet sees it")
	regDir := flag.String("registration-dir", "/registration", "the kubelet's plugins_registry directory")
	timeout := flag.Duration("timeout", 60*time.Second, "how long to wait for the plugin to answer")
	flag.Parse()
	if *csiAddr == "" || *regPath == "" {
		log.Fatal("--csi-address and --kubelet-registration-path are required")
	}
	name, err := pluginName(*csiAddr, *timeout)
	if err != nil {
		log.Fatal(err)
	}
	sock := filepath.Join(*regDir, name+"-reg.sock")
	if err := os.Remove(sock); err != nil && !os.IsNotExist(err) {
		log.Fatalf("removing the stale %s: %v", sock, err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		log.Fatalf("listening on %s: %v", sock, err)
	}
	s := &server{name: name, endpoint: *regPath, failed: make(chan string, 1)}
	g := grpc.NewServer()
	registerapi.RegisterRegistrationServer(g, s)
	go func() {
		if err := g.Serve(lis); err != nil {
			log.Fatalf("serving %s: %v", sock, err)
		}
	}()
	log.Printf("serving the registration of %s (endpoint %s) on %s", name, *regPath, sock)

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	select {
	case <-sig:
		g.Stop()
		_ = os.Remove(sock)
	case msg := <-s.failed:
		g.Stop()
		_ = os.Remove(sock)
		log.Fatalf("registration failed: %s", msg)
	}
}
