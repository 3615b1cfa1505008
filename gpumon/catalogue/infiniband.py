"""The InfiniBand (and RoCE) port metrics: the infiniband collector's and the linkflap watcher's,
each declared once (name, type, typed unit, help, labels, sink hints).

Which ``counters/`` file is read into which metric is the collector's (:mod:`gpumon.collectors.infiniband`).
"""

from __future__ import annotations

from gpumon.catalogue.hints import (
    AGG_COUNTER,
    AGG_FLAG,
    AGG_LAST,
    AGG_RATE,
    ERRORS_DESCRIPTION,
    IB,
    RECEIVE,
    STATUS_DESCRIPTION,
    TRANSMIT,
    AzureHint,
    Domain,
    InfoColumns,
    Kind,
    NoColumns,
    OtelMetric,
    camel,
    each,
    port_columns,
)
from gpumon.catalogue.units import (
    BYTES,
    BYTES_PER_SECOND,
    ERRORS,
    EVENTS,
    INFO,
    PACKETS,
    SECONDS,
    STATE,
    TICKS,
    Unit,
    count,
)
from gpumon.model import MetricSpec, MetricType

DEVICE_LABELS = ("device", "port")
COUNTER_LABELS = ("device", "port", "counter")
HW_COUNTER_COLUMN_VALUES = (
    "duplicate_request", "implied_nak_seq_err", "local_ack_timeout_err", "out_of_buffer", "out_of_sequence",
    "packet_seq_err", "req_cqe_error", "req_cqe_flush_error", "req_remote_access_errors",
    "req_remote_invalid_request", "req_rnr_retries_exceeded", "req_transport_retries_exceeded",
    "resp_cqe_error", "resp_cqe_flush_error", "resp_local_length_error", "resp_remote_access_errors",
    "rnr_nak_retry_err", "rx_atomic_requests", "rx_dct_connect", "rx_read_requests", "rx_write_requests",
    "np_cnp_sent", "np_ecn_marked_roce_packets", "roce_adp_retrans", "roce_adp_retrans_to",
    "roce_slow_restart", "roce_slow_restart_cnps", "roce_slow_restart_trans", "rp_cnp_handled",
    "rp_cnp_ignored", "rx_icrc_encapsulated"
)
"""The ``counter`` values of HW (mlx5's hw_counters/ files) that get an Azure column each:
``sources.ib_sysfs.MLX5_QUEUE_COUNTERS + MLX5_ROCE_COUNTERS`` (a test checks the two agree)."""
FLAP_SIGNAL_VALUES = ("state", "link_downed", "carrier_changes")
"""The ``signal`` values of FLAP_SIGNALS (``flaps.SIGNALS``; a test checks the two agree)."""


def _pma(name: str, help: str, unit: Unit, otel: tuple[OtelMetric, ...] = (),
         azure: tuple[AzureHint, ...] = ()) -> MetricSpec:
    """A PMA port counter (``counters/``): a counter per port."""
    return MetricSpec(name, MetricType.COUNTER, help, unit, DEVICE_LABELS, otel=otel, azure=azure)


def _io(name: str, unit: str, direction: tuple[tuple[str, str], ...], what: str) -> tuple[OtelMetric, ...]:
    """One half (receive or transmit) of hw.network.io / hw.network.packets."""
    return (OtelMetric(name, unit, Kind.COUNTER, Domain.NETWORK, direction,
                       description=f"{what} received and transmitted by the port.", semconv=True),)


def _errors(error_type: str, direction: str = "") -> tuple[OtelMetric, ...]:
    """A PMA error counter as hw.errors with hw.type=network, told apart by error.type (and direction)."""
    attributes = (("error.type", error_type),) + ((("network.io.direction", direction),) if direction else ())
    return (OtelMetric("hw.errors", "{error}", Kind.COUNTER, Domain.NETWORK, attributes,
                       description=ERRORS_DESCRIPTION, semconv=True),)


def _columns(column: str, aggs: tuple[str, ...] = ("increase",)) -> tuple[AzureHint, ...]:
    return (port_columns(column, aggs),)


# --- the PMA port counters (counters/) --------------------------------------------------
DATA_TRANSMITTED = _pma("gpumon_ib_port_data_transmitted_bytes_total",
                        "Bytes transmitted on all VLs (port_xmit_data x 4: the file counts 4-octet words).",
                        BYTES,
                        _io("hw.network.io", "By", TRANSMIT, "Bytes"),
                        _columns("DataTransmittedBytes", AGG_RATE))
DATA_RECEIVED = _pma("gpumon_ib_port_data_received_bytes_total",
                     "Bytes received on all VLs (port_rcv_data x 4: the file counts 4-octet words).",
                     BYTES,
                     _io("hw.network.io", "By", RECEIVE, "Bytes"),
                     _columns("DataReceivedBytes", AGG_RATE))
PACKETS_TRANSMITTED = _pma("gpumon_ib_port_packets_transmitted_total",
                           "Packets transmitted on all VLs.",
                           EVENTS,
                           _io("hw.network.packets", "{packet}", TRANSMIT, "Packets"),
                           _columns("PacketsTransmitted", AGG_RATE))
PACKETS_RECEIVED = _pma("gpumon_ib_port_packets_received_total",
                        "Packets received on all VLs.",
                        EVENTS,
                        _io("hw.network.packets", "{packet}", RECEIVE, "Packets"),
                        _columns("PacketsReceived", AGG_RATE))
UNICAST_TRANSMITTED = _pma("gpumon_ib_port_unicast_packets_transmitted_total",
                           "Unicast packets transmitted.", unit=PACKETS,
                           azure=_columns("UnicastPacketsTransmitted"))
UNICAST_RECEIVED = _pma("gpumon_ib_port_unicast_packets_received_total",
                        "Unicast packets received.", unit=PACKETS,
                        azure=_columns("UnicastPacketsReceived"))
MULTICAST_TRANSMITTED = _pma("gpumon_ib_port_multicast_packets_transmitted_total",
                             "Multicast packets transmitted.", unit=PACKETS,
                             azure=_columns("MulticastPacketsTransmitted"))
MULTICAST_RECEIVED = _pma("gpumon_ib_port_multicast_packets_received_total",
                          "Multicast packets received.", unit=PACKETS,
                          azure=_columns("MulticastPacketsReceived"))
SYMBOL_ERRORS = _pma("gpumon_ib_port_symbol_errors_total",
                     "Minor link errors detected on one or more physical lanes (16-bit, sticky).",
                     ERRORS,
                     _errors("symbol"),
                     _columns("SymbolErrors"))
LINK_ERROR_RECOVERIES = _pma("gpumon_ib_port_link_error_recoveries_total",
                             "Successful link retrains after an error (8-bit, sticky).", unit=EVENTS,
                             azure=_columns("LinkErrorRecoveries"))
LINK_DOWNED = _pma("gpumon_ib_port_link_downed_total",
                   "Failed link recoveries that took the link down: the flap counter (8-bit, sticky).",
                   unit=EVENTS,
                   azure=_columns("LinkDowned", AGG_COUNTER))
RECEIVE_ERRORS = _pma("gpumon_ib_port_receive_errors_total",
                      "Packets received with errors (16-bit, sticky).",
                      ERRORS,
                      _errors("receive", "receive"),
                      _columns("ReceiveErrors"))
RECEIVE_REMOTE_PHYSICAL_ERRORS = _pma("gpumon_ib_port_receive_remote_physical_errors_total",
                                      "Packets received marked with the EBP delimiter (bad upstream; 16-bit, sticky).",
                                      ERRORS,
                                      _errors("remote_physical", "receive"),
                                      _columns("ReceiveRemotePhysicalErrors"))
RECEIVE_SWITCH_RELAY_ERRORS = _pma("gpumon_ib_port_receive_switch_relay_errors_total",
                                   "Packets discarded because they could not be forwarded by the switch relay (16-bit).",
                                   ERRORS,
                                   _errors("switch_relay", "receive"),
                                   _columns("ReceiveSwitchRelayErrors"))
TRANSMIT_DISCARDS = _pma("gpumon_ib_port_transmit_discards_total",
                         "Outbound packets discarded because the port was down or congested (16-bit, sticky).",
                         unit=PACKETS,
                         azure=_columns("TransmitDiscards"))
TRANSMIT_CONSTRAINT_ERRORS = _pma("gpumon_ib_port_transmit_constraint_errors_total",
                                  "Packets not transmitted because of outbound raw filtering constraints (8-bit).",
                                  ERRORS,
                                  _errors("constraint", "transmit"),
                                  _columns("TransmitConstraintErrors"))
RECEIVE_CONSTRAINT_ERRORS = _pma("gpumon_ib_port_receive_constraint_errors_total",
                                 "Packets discarded because of inbound raw filtering constraints (8-bit).",
                                 ERRORS,
                                 _errors("constraint", "receive"),
                                 _columns("ReceiveConstraintErrors"))
LOCAL_LINK_INTEGRITY_ERRORS = _pma("gpumon_ib_port_local_link_integrity_errors_total",
                                   "Times local physical errors exceeded the threshold (4-bit, sticky).",
                                   ERRORS,
                                   _errors("local_link_integrity"),
                                   _columns("LocalLinkIntegrityErrors"))
EXCESSIVE_BUFFER_OVERRUN_ERRORS = _pma("gpumon_ib_port_excessive_buffer_overrun_errors_total",
                                       "Consecutive flow-control update periods with buffer overrun (4-bit, sticky).",
                                       ERRORS,
                                       _errors("excessive_buffer_overrun"),
                                       _columns("ExcessiveBufferOverrunErrors"))
VL15_DROPPED = _pma("gpumon_ib_port_vl15_dropped_total",
                    "Subnet management packets (VL15) dropped for lack of buffers (16-bit, sticky).",
                    unit=PACKETS,
                    azure=_columns("Vl15Dropped"))
TRANSMIT_WAIT = _pma("gpumon_ib_port_transmit_wait_ticks_total",
                     "Ticks during which the port had data to send but no flow-control credits: "
                                "congestion (32-bit, sticky; tick length is implementation defined).",
                     TICKS,
                     azure=_columns("TransmitWaitTicks", ("increase", "rate")))

# --- the port (infiniband collector) --------------------------------------------------
SPEC_INFO = MetricSpec(
    "gpumon_ib_port_info", MetricType.INFO,
    "Identity of an RDMA port; value 1. netdev lists the port's network interfaces, comma separated.",
    unit=INFO,
    labels=("device", "port", "link_layer", "fw_version", "board_id", "hca_type", "node_guid", "netdev"),
    azure=(InfoColumns("", IB, (
        ("link_layer", "LinkLayer"), ("fw_version", "FirmwareVersion"), ("board_id", "BoardId"),
        ("hca_type", "HcaType"), ("node_guid", "NodeGuid"), ("netdev", "Netdev"))),))
SPEC_STATE = MetricSpec(
    "gpumon_ib_port_state", MetricType.GAUGE,
    "Logical port state as the kernel numbers it: 1 DOWN, 2 INIT, 3 ARMED, 4 ACTIVE, 5 ACTIVE_DEFER.",
    unit=STATE,
    labels=DEVICE_LABELS, azure=(port_columns("State", AGG_LAST),))
SPEC_PHYS = MetricSpec(
    "gpumon_ib_port_phys_state", MetricType.GAUGE,
    "Physical port state: 1 Sleep, 2 Polling, 3 Disabled, 4 PortConfigurationTraining, 5 LinkUp, "
    "6 LinkErrorRecovery, 7 PhyTest.",
    unit=STATE, labels=DEVICE_LABELS, azure=(port_columns("PhysState", AGG_LAST),))
SPEC_UP = MetricSpec(
    "gpumon_ib_port_up", MetricType.GAUGE,
    "1 when the port is ACTIVE and its physical link is LinkUp, else 0.", unit=STATE, labels=DEVICE_LABELS,
    otel=(OtelMetric("hw.network.up", "1", Kind.UPDOWN, Domain.NETWORK, semconv=True),
          OtelMetric("hw.status", "1", Kind.STATUS, Domain.NETWORK, semconv=True,
                     description=STATUS_DESCRIPTION)),
    azure=(port_columns("Up", ("min", "max")),))
SPEC_RATE = MetricSpec(
    "gpumon_ib_port_rate_bytes_per_second", MetricType.GAUGE,
    "Negotiated link rate (the rate file's Gb/s x 10^9 / 8).", BYTES_PER_SECOND, DEVICE_LABELS,
    otel=(OtelMetric("hw.network.bandwidth.limit", "By/s", Kind.UPDOWN, Domain.NETWORK, semconv=True),),
    azure=(port_columns("RateBytesPerSecond", AGG_LAST),))
SPEC_PMA_OTHER = MetricSpec(
    "gpumon_ib_port_pma_other_total", MetricType.COUNTER,
    "A counters/ file this version of gpumon does not know by name, exported raw.", unit=EVENTS,
    labels=COUNTER_LABELS,
    azure=(NoColumns("counters/ files gpumon does not know by name: no fixed column"),))
SPEC_HW = MetricSpec(
    "gpumon_ib_hw_stat_total", MetricType.COUNTER,
    "A driver counter from hw_counters/ (whatever the firmware offers), named by the counter label.",
    unit=EVENTS,
    labels=COUNTER_LABELS,
    # one Azure column per mlx5 counter, named by the file; others the firmware offers go to the other sinks
    azure=(port_columns("", ("increase",), split_label="counter", split=tuple(
        (name, camel(name)) for name in HW_COUNTER_COLUMN_VALUES)),))
SPEC_SATURATED = MetricSpec(
    "gpumon_ib_port_saturated", MetricType.GAUGE,
    "1 for a counter stuck at the maximum of its width: it no longer counts (reset it with "
    "perfquery -R). Only stuck counters have a series.", unit=STATE, labels=COUNTER_LABELS,
    azure=(port_columns("CountersSaturated", AGG_LAST),))

# --- the flap watcher (linkflap collector) --------------------------------------------------
SPEC_FLAPS = MetricSpec(
    "gpumon_ib_link_flaps_total", MetricType.COUNTER,
    "Link flaps (down and back) since gpumon started; one flap seen by several signals counts once.",
    unit=count("flap"),
    labels=DEVICE_LABELS, azure=(port_columns("Flaps", AGG_COUNTER),))
SPEC_SIGNALS = MetricSpec(
    "gpumon_ib_link_flap_signals_total", MetricType.COUNTER,
    "Flaps each signal saw (state, link_downed, carrier_changes), before de-duplication.",
    unit=count("signal"),
    labels=("device", "port", "signal"),
    azure=(port_columns("FlapSignals", ("increase",), split_label="signal", split=each("", FLAP_SIGNAL_VALUES)),))
SPEC_WINDOW = MetricSpec(
    "gpumon_ib_port_flaps_in_window", MetricType.GAUGE,
    "Flaps within the flap window (default 24 h), kept across restarts.",
    unit=count("flap"), labels=DEVICE_LABELS,
    azure=(port_columns("FlapsInWindow", AGG_LAST),))
SPEC_FLAPPING = MetricSpec(
    "gpumon_ib_port_flapping", MetricType.GAUGE,
    "1 when flaps in the window reach the threshold (default 5 in 24 h, as Azure's NHC2005), else 0.",
    unit=STATE,
    labels=DEVICE_LABELS, azure=(port_columns("Flapping", AGG_FLAG),))
SPEC_LAST = MetricSpec(
    "gpumon_ib_last_flap_timestamp_seconds", MetricType.GAUGE,
    "Unix time of the port's last flap (only ports that have flapped within the window or since start).",
    SECONDS, DEVICE_LABELS, azure=(port_columns("LastFlapTimestampSeconds", AGG_LAST),))
SPEC_DOWN = MetricSpec(
    "gpumon_ib_port_down_seconds", MetricType.GAUGE,
    "How long the port has been seen down (not ACTIVE/LinkUp); 0 while up.", SECONDS, DEVICE_LABELS,
    azure=(port_columns("DownSeconds", ("max",)),))
SPEC_LAST_DOWN = MetricSpec(
    "gpumon_ib_port_last_down_duration_seconds", MetricType.GAUGE,
    "How long the last completed down period lasted, to within one watch interval.", SECONDS,
    DEVICE_LABELS, azure=(port_columns("LastDownDurationSeconds", AGG_LAST),))
